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
