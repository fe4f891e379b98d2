/* Weight-only GGUF block matmuls on the CPU: out[M, N] = x[M, K] @ W^T with float32 activations.
 *
 * W stays in its GGUF blocks of 32 weights along K; a weight is rebuilt in registers as
 * w = d * q + m (Q4_1; Q4_0 is the same with m = -8 d) or w = d * q (Q8_0) and multiplied into
 * float32 accumulators, so the result is the float32 matmul of the dequantized weight up to the
 * order of the float32 additions. Decode reads the weight once per step, so what matters is bytes
 * (0.75 per Q4 weight here, 4 in float32) and the instructions per weight, which a tile of TILE_N (2)
 * output rows x up to TILE_M (8) input rows shares: each weight is unpacked once per 8 input rows, each
 * input vector loaded once per tile (into a register: folded into the FMAs, GCC loaded it once per
 * output row), and each weight vector meets an input vector in one FMA (written as one sum, w_lo x_lo
 * + w_hi x_hi costs a multiply, an FMA and an add). The 16 accumulators are reduced together at the
 * end of K by one transpose-and-sum (K = 576 is only 18 blocks: 16 separate log-step sums cost ~5% at
 * 8 rows, a scalar sum 12%). Layout
 * (prepared by conveyor.model.quantized):
 *   Q4: qs [N, K/2] uint8, block b of row n at bytes [16 b, 16 b + 16): byte j holds element j in its
 *       low nibble and element j + 16 in its high nibble (GGUF's order); d, m [N, K/32] float32.
 *   Q8: qs [N, K] int8; d [N, K/32] float32.
 * Written with GCC vector extensions (AVX-512 with -march=native on x86, NEON on ARM); OpenMP splits
 * the output rows over `num_threads` threads. A single input row is the exception: q4_one_row and
 * q8_0_one_row factor d and m out of each block (same value up to float32 rounding order).
 */
#include <stdlib.h>

#include "vec.h"

typedef uint8_t v16u8 __attribute__((vector_size(16)));
#define QK 32
#ifndef TILE_N
#define TILE_N 2
#endif
#ifndef TILE_M
#define TILE_M 8
#endif
/* Two steps: a direct u8 -> float conversion is scalarized by GCC 12. */
#define TO_FLOAT(v) __builtin_convertvector(__builtin_convertvector((v), v16i), v16f)

/* The weights of block b of row n as two vectors: elements [0, 16) and [16, 32). */
INLINE void q4_block(const uint8_t* qs, const float* d, const float* m, int64_t K, int64_t n, int64_t b,
                     v16f* lo, v16f* hi) {
  const int64_t nb = K / QK;
  v16u8 raw;
  memcpy(&raw, qs + n * (K / 2) + b * 16, 16);
  const float scale = d[n * nb + b], offset = m[n * nb + b];
  *lo = TO_FLOAT(raw & 0x0F) * scale + offset;
  *hi = TO_FLOAT(raw >> 4) * scale + offset;
}

INLINE void q8_block(const int8_t* qs, const float* d, int64_t K, int64_t n, int64_t b, v16f* lo, v16f* hi) {
  /* GCC 12 scalarizes int8 -> int32 conversions, so the codes are read as bytes biased by 128
   * (q + 128 = byte ^ 0x80, zero-extended like the Q4 nibbles) and w = d (q + 128) - 128 d, which is
   * d q exactly (every term fits float32's 24 bits). */
  v16u8 q0, q1;
  memcpy(&q0, qs + n * K + b * QK, 16);
  memcpy(&q1, qs + n * K + b * QK + 16, 16);
  const float scale = d[n * (K / QK) + b], offset = -128.0f * scale;
  *lo = TO_FLOAT(q0 ^ 0x80) * scale + offset;
  *hi = TO_FLOAT(q1 ^ 0x80) * scale + offset;
}

/* out[r * N + j] = the lane sum of acc[j][r]: one transpose-and-sum for 8 or more accumulators. */
INLINE void store_sums(v16f acc[][TILE_M > 8 ? 8 : TILE_M], const int cols, const int rows, float* out, int64_t N) {
  if (cols * rows < 8) {
    for (int j = 0; j < cols; j++)
      for (int r = 0; r < rows; r++) out[r * N + j] = hsum16(acc[j][r]);
    return;
  }
  v16f p[16];  /* p[j rows + r] = acc[j][r], zero past cols x rows */
  for (int i = 0; i < 16; i++) p[i] = i < cols * rows ? acc[i / rows][i % rows] : (v16f){0};
  const v16f sums = transpose_sum(p);
  for (int i = 0; i < cols * rows; i++) out[(i % rows) * N + i / rows] = sums[i];
}

/* out rows [0, rows) x columns [n0, n0 + cols) of one tile; cols, rows compile-time after inlining. */
INLINE void tile(const float* x, int64_t K, const void* qs, const float* d, const float* m,
                 int64_t n0, int64_t N, float* out, const int cols, const int rows) {
  v16f acc[TILE_N][TILE_M > 8 ? 8 : TILE_M];
  for (int j = 0; j < cols; j++)
    for (int r = 0; r < rows; r++) acc[j][r] = (v16f){0};
  for (int64_t b = 0; b < K / QK; b++) {
    v16f lo[TILE_N], hi[TILE_N];
    for (int j = 0; j < cols; j++) {
      if (m) q4_block((const uint8_t*)qs, d, m, K, n0 + j, b, &lo[j], &hi[j]);
      else q8_block((const int8_t*)qs, d, K, n0 + j, b, &lo[j], &hi[j]);
    }
    for (int r = 0; r < rows; r++) {
      const float* xb = x + (b * rows + r) * QK;  /* packed: [K/32][rows][32] */
      v16f x0 = load16(xb), x1 = load16(xb + 16);
      if (cols > 1) __asm__("" : "+v"(x0), "+v"(x1));  /* keep them in registers: one load, not one per column */
      for (int j = 0; j < cols; j++) {
        if (cols * rows == 1) acc[j][r] += lo[j] * x0 + hi[j] * x1;  /* one accumulator: keep its chain short */
        else acc[j][r] += lo[j] * x0, acc[j][r] += hi[j] * x1;
      }
    }
  }
  store_sums(acc, cols, rows, out + n0, N);
}

#define ROW_CASE(COLS, R) case R: if (R <= TILE_M) tile(xr, K, qs, d, m, n0, N, outr, COLS, R <= TILE_M ? R : 1); break;
#define ROWS_CASES(COLS)                                                                          \
  switch (rows) {                                                                                 \
    ROW_CASE(COLS, 1) ROW_CASE(COLS, 2) ROW_CASE(COLS, 3) ROW_CASE(COLS, 4)                       \
    ROW_CASE(COLS, 5) ROW_CASE(COLS, 6) ROW_CASE(COLS, 7) ROW_CASE(COLS, 8)                       \
  }

/* x [M, K] -> packed [M/TILE_M tiles][K/32][rows][32]: a tile's rows of one block lie side by side,
 * so its inner loop reads one stream from one pointer (8 row pointers cost registers and 7% at 8 rows). */
static void pack_rows(const float* x, int64_t M, int64_t K, float* packed) {
  for (int64_t r0 = 0; r0 < M; r0 += TILE_M) {
    const int64_t rows = M - r0 < TILE_M ? M - r0 : TILE_M;
    for (int64_t b = 0; b < K / QK; b++)
      for (int64_t r = 0; r < rows; r++)
        memcpy(packed + r0 * K + (b * rows + r) * QK, x + (r0 + r) * K + b * QK, QK * sizeof(float));
  }
}

/* sum_b a[b] c[b] over [0, count): the per-block offset terms of one output row. */
INLINE float dot(const float* a, const float* c, int64_t count) {
  v16f sums = (v16f){0};
  int64_t b = 0;
  for (; b + 16 <= count; b += 16) sums += load16(a + b) * load16(c + b);
  float sum = hsum16(sums);
  for (; b < count; b++) sum += a[b] * c[b];
  return sum;
}

/* One input row (a batch-1 decode) times a Q4 weight, factored per block as
 *   sum_b [ d_b (q_b . x_b) + m_b sum(x_b) ]
 * so each weight is only converted and multiplied into x: the tile path's w = d q + m costs two more
 * FMAs and a broadcast per block of 16 weights, and at one input row nothing shares them (the step's
 * Q4 matmuls are compute-bound there, not bound by the weights' bytes). The block sums of x are taken
 * once per call, and the m_b terms summed per output row as one short dot product after its K loop.
 * Same value as w = d q + m up to float32 rounding order (a few ulps more: the two terms partly cancel). */
static void q4_one_row(const float* x, int64_t K, const uint8_t* qs, const float* d, const float* m, int64_t N,
                       float* out, int num_threads) {
  const int64_t nb = K / QK;
  float xsum[nb];  /* [K/32]: sum of x over each block */
  for (int64_t b = 0; b < nb; b++) xsum[b] = hsum16(load16(x + b * QK) + load16(x + b * QK + 16));
  #pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t n = 0; n < N; n++) {
    const uint8_t* row = qs + n * (K / 2);
    const float *dn = d + n * nb, *mn = m + n * nb;
    v16f acc = (v16f){0};
    for (int64_t b = 0; b < nb; b++) {
      v16u8 raw;
      memcpy(&raw, row + b * 16, 16);
      const v16f dot = TO_FLOAT(raw & 0x0F) * load16(x + b * QK) + TO_FLOAT(raw >> 4) * load16(x + b * QK + 16);
      acc += dot * dn[b];
    }
    out[n] = hsum16(acc) + dot(mn, xsum, nb);
  }
}

/* The Q8_0 counterpart of q4_one_row: codes read as bytes biased by 128 (q8_block's trick), so a block is
 * d_b ((q_b + 128) . x_b) - 128 d_b sum(x_b). */
static void q8_0_one_row(const float* x, int64_t K, const int8_t* qs, const float* d, int64_t N, float* out,
                         int num_threads) {
  const int64_t nb = K / QK;
  float xsum[nb];  /* [K/32]: -128 x the sum of x over each block */
  for (int64_t b = 0; b < nb; b++) xsum[b] = -128.0f * hsum16(load16(x + b * QK) + load16(x + b * QK + 16));
  #pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t n = 0; n < N; n++) {
    const int8_t* row = qs + n * K;
    const float* dn = d + n * nb;
    v16f acc = (v16f){0};
    for (int64_t b = 0; b < nb; b++) {
      v16u8 q0, q1;
      memcpy(&q0, row + b * QK, 16);
      memcpy(&q1, row + b * QK + 16, 16);
      const v16f dot = TO_FLOAT(q0 ^ 0x80) * load16(x + b * QK) + TO_FLOAT(q1 ^ 0x80) * load16(x + b * QK + 16);
      acc += dot * dn[b];
    }
    out[n] = hsum16(acc) + dot(dn, xsum, nb);
  }
}

/* m == NULL selects Q8_0 blocks, else Q4 blocks (one specialized copy each after inlining). One input
 * row (a batch-1 decode) takes the factored *_one_row kernels. */
static int block_matmul(const float* x_rows, int64_t M, int64_t K, const void* qs, const float* d,
                        const float* m, int64_t N, float* out, int num_threads) {
  if (M == 1 && m) {
    q4_one_row(x_rows, K, (const uint8_t*)qs, d, m, N, out, num_threads);
    return 0;
  }
  if (M == 1) {
    q8_0_one_row(x_rows, K, (const int8_t*)qs, d, N, out, num_threads);
    return 0;
  }
  float* packed = M > 1 ? malloc(M * K * sizeof(float)) : NULL;
  if (M > 1 && !packed) return 1;
  if (packed) pack_rows(x_rows, M, K, packed);
  const float* x = packed ? packed : x_rows;  /* one row is its own packing */
  const int64_t tile_n = M > 1 ? TILE_N : 1, num_tiles = (N + tile_n - 1) / tile_n;
  #pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t t = 0; t < num_tiles; t++) {
    const int64_t n_begin = t * tile_n, n_end = n_begin + tile_n < N ? n_begin + tile_n : N;
    for (int64_t r0 = 0; r0 < M; r0 += TILE_M) {
      const int64_t rows = M - r0 < TILE_M ? M - r0 : TILE_M;
      const float* xr = x + r0 * K;
      float* outr = out + r0 * N;
      if (tile_n == TILE_N && n_end - n_begin == TILE_N) {
        const int64_t n0 = n_begin;
        ROWS_CASES(TILE_N)
      } else {
        for (int64_t n0 = n_begin; n0 < n_end; n0++) ROWS_CASES(1)
      }
    }
  }
  free(packed);
  return 0;
}

/* Both return 0, or 1 where the packed copy of x could not be allocated. */
int q4_matmul(const float* x, int64_t M, int64_t K, const uint8_t* qs, const float* d, const float* m,
              int64_t N, float* out, int num_threads) {
  return block_matmul(x, M, K, qs, d, m, N, out, num_threads);
}

int q8_0_matmul(const float* x, int64_t M, int64_t K, const int8_t* qs, const float* d,
                int64_t N, float* out, int num_threads) {
  return block_matmul(x, M, K, qs, d, NULL, N, out, num_threads);
}

/* out [N, K] float32 = the dequantized weight (prefill-sized inputs multiply it with BLAS). */
void q4_dequantize(const uint8_t* qs, const float* d, const float* m, int64_t N, int64_t K, float* out,
                   int num_threads) {
  #pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t n = 0; n < N; n++)
    for (int64_t b = 0; b < K / QK; b++) {
      v16f lo, hi;
      q4_block(qs, d, m, K, n, b, &lo, &hi);
      memcpy(out + n * K + b * QK, &lo, sizeof lo);
      memcpy(out + n * K + b * QK + 16, &hi, sizeof hi);
    }
}

void q8_0_dequantize(const int8_t* qs, const float* d, int64_t N, int64_t K, float* out, int num_threads) {
  #pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t n = 0; n < N; n++)
    for (int64_t b = 0; b < K / QK; b++) {
      v16f lo, hi;
      q8_block(qs, d, K, n, b, &lo, &hi);
      memcpy(out + n * K + b * QK, &lo, sizeof lo);
      memcpy(out + n * K + b * QK + 16, &hi, sizeof hi);
    }
}
