/* Vector helpers shared by the CPU kernels (GCC vector extensions: AVX-512 with -march=native on
 * x86, NEON on ARM, plain SSE otherwise). */
#ifndef CONVEYOR_VEC_H
#define CONVEYOR_VEC_H
#include <stdint.h>
#include <string.h>

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
#define INLINE static inline __attribute__((always_inline))

INLINE v16f load16(const float* p) { v16f v; memcpy(&v, p, sizeof v); return v; }
INLINE v16f splat(float x) { return (v16f){0} + x; }

INLINE v16f vselect(v16i mask, v16f a, v16f b) {  /* lane-wise mask ? a : b (C has no vector ?:) */
  v16i ai, bi, r;
  memcpy(&ai, &a, sizeof a), memcpy(&bi, &b, sizeof b);
  r = (ai & mask) | (bi & ~mask);
  v16f out;
  memcpy(&out, &r, sizeof out);
  return out;
}

/* e^x for 16 lanes (Cephes' expf polynomial, ~1 ulp): x = n ln2 + r, e^x = 2^n e^r. */
INLINE v16f exp16(v16f x) {
  const v16f hi = splat(88.3762626647949f), lo = splat(-88.3762626647949f);
  x = vselect(x < hi, x, hi);
  x = vselect(x > lo, x, lo);
  const v16f t = x * 1.44269504088896341f + 0.5f;
  v16f n = __builtin_convertvector(__builtin_convertvector(t, v16i), v16f);
  n += __builtin_convertvector(n > t, v16f);  /* truncated up (t < 0): the mask is -1, giving floor(t) */
  v16f r = x - n * 0.693359375f + n * 2.12194440e-4f;
  v16f y = splat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  v16i bits = (__builtin_convertvector(n, v16i) + 127) << 23;
  v16f scale;
  memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

INLINE v16f vmax(v16f a, v16f b) { return vselect(a > b, a, b); }
/* Horizontal max and sum in log steps (4 shuffles and 4 ops): a scalar loop over the lanes is a
 * 16-long dependency chain. */
INLINE float hmax(v16f v) {
  v = vmax(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  v = vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return v[0];
}
INLINE float hsum16(v16f v) {
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}

/* lane i of the result = sum (or, with MAX, the maximum) of the 16 lanes of p[i]: a 16 x 16
 * transpose-and-reduce in 4 rounds of shuffles, 30 shuffles and 15 adds instead of 16 horizontal
 * reductions (the attention kernels' per-key scores and softmax statistics, the block matmul's
 * accumulators at the end of K). */
#define COMBINE(a, b) (MAX ? vmax((a), (b)) : (a) + (b))
INLINE v16f transpose_reduce(v16f p[16], const int MAX) {
  v16f a[8], b[4], c[2];
  for (int i = 0; i < 8; i++)  /* a[i] = [p[2i] halves summed (8) | p[2i+1] halves summed (8)] */
    a[i] = COMBINE(__builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),
                   __builtin_shufflevector(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31));
  for (int i = 0; i < 4; i++)  /* b[i] = [p4i (4) | p4i+2 (4) | p4i+1 (4) | p4i+3 (4)] */
    b[i] = COMBINE(__builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27),
                   __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31));
  for (int i = 0; i < 2; i++)  /* 2 lanes per input vector */
    c[i] = COMBINE(__builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29),
                   __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31));
  const v16f d = COMBINE(__builtin_shufflevector(c[0], c[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30),
                         __builtin_shufflevector(c[0], c[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31));
  /* d holds the sums in the order the rounds interleaved them; put p[i]'s in lane i */
  return __builtin_shufflevector(d, d, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}
#undef COMBINE
INLINE v16f transpose_sum(v16f p[16]) { return transpose_reduce(p, 0); }
INLINE v16f transpose_max(v16f p[16]) { return transpose_reduce(p, 1); }

#endif
