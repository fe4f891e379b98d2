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

#endif
