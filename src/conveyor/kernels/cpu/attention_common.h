/* What the CPU attention kernels share: the cache geometry, the 16-token chunk and its scoring.
 * A chunk is CHUNK keys of one KV head, never crossing a block; its scores are one vector. */
#ifndef CONVEYOR_ATTENTION_COMMON_H
#define CONVEYOR_ATTENTION_COMMON_H
#include <math.h>

#include "vec.h"

typedef struct {
  int64_t num_heads, num_kv_heads, head_dim, block_size, num_blocks;
} Geometry;

#define CHUNK 16  /* tokens scored at once: one vector of scores */
#define MAX_GROUP 16  /* query heads per KV head */
#define MAX_VECS 16  /* head_dim <= 256 */

/* lane i of the result = sum (or, with MAX, the maximum) of the 16 lanes of p[i]: a 16 x 16
 * transpose-and-reduce in 4 rounds of shuffles, 30 shuffles and 15 adds instead of 16 horizontal
 * reductions. */
#define COMBINE(a, b) (MAX ? vmax((a), (b)) : (a) + (b))
INLINE v16f transpose_reduce(v16f p[16], const int MAX) {
  v16f a[8], b[4], c[2];
  for (int i = 0; i < 8; i++)  /* a[i] = [p[2i] halves summed (8) | p[2i+1] halves summed (8)] */
    a[i] = COMBINE(__builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),
                   __builtin_shufflevector(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31));
  for (int i = 0; i < 4; i++)  /* b[i] = [p4i (4) | p4i+2 (4) | p4i+1 (4) | p4i+3 (4)] */
    b[i] = COMBINE(__builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27),
                   __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31));
  for (int i = 0; i < 2; i++)  /* 2 lanes per token */
    c[i] = COMBINE(__builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29),
                   __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31));
  const v16f d = COMBINE(__builtin_shufflevector(c[0], c[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30),
                         __builtin_shufflevector(c[0], c[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31));
  /* d holds the tokens in the order the rounds interleaved them; put token i in lane i */
  return __builtin_shufflevector(d, d, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}
#undef COMBINE
INLINE v16f transpose_sum(v16f p[16]) { return transpose_reduce(p, 0); }
INLINE v16f transpose_max(v16f p[16]) { return transpose_reduce(p, 1); }

/* Lane t = q . k_t for the n (<= CHUNK) keys at k (row stride `stride`); lanes >= n are -inf.
 * n == CHUNK, the common case, is a separate fully unrolled copy: with a runtime bound GCC kept the
 * 16 partial sums on the stack (and zeroed them with memset) instead of in registers. */
INLINE v16f score_chunk(const v16f* qv, const float* k, int64_t stride, int64_t n, const int V) {
  v16f partial[CHUNK];
  if (n == CHUNK) {
    for (int t = 0; t < CHUNK; t++) {
      partial[t] = qv[0] * load16(k + t * stride);
      for (int c = 1; c < V; c++) partial[t] += qv[c] * load16(k + t * stride + 16 * c);
    }
    return transpose_sum(partial);
  }
  for (int t = 0; t < CHUNK; t++) {
    partial[t] = (v16f){0};
    if (t < n)
      for (int c = 0; c < V; c++) partial[t] += qv[c] * load16(k + t * stride + 16 * c);
  }
  v16f scores = transpose_sum(partial);
  for (int t = (int)n; t < CHUNK; t++) scores[t] = -INFINITY;
  return scores;
}

#endif
