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
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

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

#if defined(__AVX2__) && !defined(__AVX512F__)
/* AVX2: GCC 12 scalarizes TO_FLOAT of a 16-lane vector here (10-20x slower matmuls on a Zen 3), so the
 * codes are widened 8 at a time by vpmovzxbd / vpmovsxbd and converted exactly (same values). */
INLINE v16f avx2_join(__m256 a, __m256 b) { v16f v; memcpy(&v, &a, 32), memcpy((char*)&v + 32, &b, 32); return v; }
INLINE v16f avx2_u8_to_float(__m128i raw) {
  return avx2_join(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(raw)),
                   _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(raw, 8))));
}
INLINE v16f avx2_i8_to_float(__m128i raw) {
  return avx2_join(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)),
                   _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8))));
}
INLINE void avx2_q4_codes(const uint8_t* p, v16f* lo, v16f* hi) {
  const __m128i raw = _mm_loadu_si128((const __m128i*)p), low4 = _mm_set1_epi8(0x0F);
  *lo = avx2_u8_to_float(_mm_and_si128(raw, low4));
  *hi = avx2_u8_to_float(_mm_and_si128(_mm_srli_epi16(raw, 4), low4));
}
#endif

/* The weights of block b of row n as two vectors: elements [0, 16) and [16, 32). */
INLINE void q4_block(const uint8_t* qs, const float* d, const float* m, int64_t K, int64_t n, int64_t b,
                     v16f* lo, v16f* hi) {
  const int64_t nb = K / QK;
  v16u8 raw;
  memcpy(&raw, qs + n * (K / 2) + b * 16, 16);
  const float scale = d[n * nb + b], offset = m[n * nb + b];
#if defined(__AVX2__) && !defined(__AVX512F__)
  avx2_q4_codes(qs + n * (K / 2) + b * 16, lo, hi);
  *lo = *lo * scale + offset, *hi = *hi * scale + offset;
  return;
#endif
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
#if defined(__AVX2__) && !defined(__AVX512F__)
  *lo = avx2_u8_to_float((__m128i)(q0 ^ 0x80)) * scale + offset;  /* the same biased codes, widened fast */
  *hi = avx2_u8_to_float((__m128i)(q1 ^ 0x80)) * scale + offset;
  return;
#endif
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
#ifdef __AVX512F__  /* a 64-byte vector fits one zmm register; on AVX2 it spans two, and "+v" is impossible */
      if (cols > 1) __asm__("" : "+v"(x0), "+v"(x1));  /* keep them in registers: one load, not one per column */
#endif
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

/* One input row (a batch-1 decode) times a block weight, factored per block: Q4 is
 *   sum_b [ d_b (q_b . x_b) + m_b sum(x_b) ]
 * and Q8_0 is sum_b d_b (q_b . x_b), so each weight is only converted and multiplied into x (the tile
 * path's w = d q + m costs two more FMAs and a broadcast per 16 weights, and at one input row nothing
 * shares them). The block sums of x are taken once per call; the m_b terms are one short dot product
 * per output row, added into its lanes. Each row keeps two accumulators (even and odd blocks: one FMA
 * chain of K/32 links was the loop's bound), and 16 rows are reduced together by one transpose-and-sum
 * (a horizontal sum per row cost as much as an 18-block row's loop). Same value as w = d q + m up to
 * float32 rounding order (a few ulps more for Q4: the two terms partly cancel). */
#ifdef __AVX512F__
/* AVX-512 (x86 with -march=native): one zero-extension of the 16 bytes, and the 4-bit codes looked up
 * as floats by vpermps, which reads only the low 4 bits of each index (no mask, no conversion). */
INLINE void q4_codes(const uint8_t* p, v16f* lo, v16f* hi) {
  const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i wide = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  *lo = (v16f)_mm512_permutexvar_ps(wide, table);
  *hi = (v16f)_mm512_permutexvar_ps(_mm512_srli_epi32(wide, 4), table);
}
#define Q8_BIAS 0.0f /* int8 -> int32 by vpmovsxbd: the codes as they are */
INLINE void q8_codes(const int8_t* p, v16f* lo, v16f* hi) {
  *lo = (v16f)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
  *hi = (v16f)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 16))));
}
#elif defined(__AVX2__)
INLINE void q4_codes(const uint8_t* p, v16f* lo, v16f* hi) { avx2_q4_codes(p, lo, hi); }
#define Q8_BIAS 0.0f /* int8 -> int32 by vpmovsxbd, as on AVX-512 */
INLINE void q8_codes(const int8_t* p, v16f* lo, v16f* hi) {
  *lo = avx2_i8_to_float(_mm_loadu_si128((const __m128i*)p));
  *hi = avx2_i8_to_float(_mm_loadu_si128((const __m128i*)(p + 16)));
}
#else
INLINE void q4_codes(const uint8_t* p, v16f* lo, v16f* hi) {
  v16u8 raw;
  memcpy(&raw, p, 16);
  *lo = TO_FLOAT(raw & 0x0F), *hi = TO_FLOAT(raw >> 4);
}
#define Q8_BIAS 128.0f /* GCC scalarizes int8 -> int32: codes read as bytes biased by 128 (q8_block) */
INLINE void q8_codes(const int8_t* p, v16f* lo, v16f* hi) {
  v16u8 q0, q1;
  memcpy(&q0, p, 16), memcpy(&q1, p + 16, 16);
  *lo = TO_FLOAT(q0 ^ 0x80), *hi = TO_FLOAT(q1 ^ 0x80);
}
#endif

/* sum_b a[b] c[b] over [0, count), spread over the lanes (their sum is the value). */
INLINE v16f lanes_dot(const float* a, const float* c, int64_t count) {
  v16f sums = (v16f){0};
  int64_t b = 0;
  for (; b + 16 <= count; b += 16) sums += load16(a + b) * load16(c + b);
  for (; b < count; b++) sums[0] += a[b] * c[b];
  return sums;
}

/* (q_b . x_b) d_b for block b of a row (Q4 when q4, else Q8_0 codes). */
INLINE v16f block_term(const void* row, const float* x, float scale, int64_t b, const int q4) {
  v16f lo, hi;
  if (q4) q4_codes((const uint8_t*)row + b * 16, &lo, &hi);
  else q8_codes((const int8_t*)row + b * QK, &lo, &hi);
  return (lo * load16(x + b * QK) + hi * load16(x + b * QK + 16)) * scale;
}

/* Software prefetch of row n + PREFETCH_ROWS (its codes, scales and offsets) before row n is read: with a
 * row's ~7 instructions per 16 weights in flight, the hardware prefetchers alone kept too few lines in
 * flight, and the matmuls read DRAM at about half a plain read's bandwidth (Xeon, one thread: the 120
 * Q4 matmuls 11.2 -> 8.9 ms, the Q8_0 LM head 4.2 -> 3.3 ms). A prefetch never faults, so the last rows'
 * prefetches past the end of the weight are harmless. */
#define PREFETCH_ROWS 4
INLINE void prefetch_row(const uint8_t* row, int64_t bytes, const float* dn, const float* on, int64_t nb) {
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(row + PREFETCH_ROWS * bytes + off);
  for (int64_t off = 0; off < nb; off += 16) {
    __builtin_prefetch(dn + PREFETCH_ROWS * nb + off);
    __builtin_prefetch(on + PREFETCH_ROWS * nb + off);
  }
}

/* Output row n as 16 lanes to be summed; offsets = m (Q4) or d (Q8_0), xsum = the matching block sums. */
INLINE v16f one_row_lanes(const float* x, int64_t K, const void* qs, const float* d, const float* offsets,
                          const float* xsum, int64_t n, const int q4) {
  const int64_t nb = K / QK;
  const void* row = (const uint8_t*)qs + n * (q4 ? K / 2 : K);
  const float* dn = d + n * nb;
  prefetch_row(row, q4 ? K / 2 : K, dn, offsets + n * nb, nb);
  v16f even = (v16f){0}, odd = (v16f){0};
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    even += block_term(row, x, dn[b], b, q4);
    odd += block_term(row, x, dn[b + 1], b + 1, q4);
  }
  if (b < nb) even += block_term(row, x, dn[b], b, q4);
  if (!q4 && Q8_BIAS == 0.0f) return even + odd;
  return even + odd + lanes_dot(offsets + n * nb, xsum, nb);
}

static void one_row(const float* x, int64_t K, const void* qs, const float* d, const float* m, int64_t N,
                    float* out, int num_threads, const int q4) {
  const int64_t nb = K / QK, groups = (N + 15) / 16;
  float xsum[nb];  /* [K/32]: the sum of x over each block (Q4), or -Q8_BIAS times it (Q8_0) */
  for (int64_t b = 0; b < nb; b++)
    xsum[b] = (q4 ? 1.0f : -Q8_BIAS) * hsum16(load16(x + b * QK) + load16(x + b * QK + 16));
  #pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t g = 0; g < groups; g++) {
    const int64_t n0 = g * 16, rows = N - n0 < 16 ? N - n0 : 16;
    v16f p[16];
    for (int64_t i = 0; i < 16; i++)
      p[i] = i < rows ? one_row_lanes(x, K, qs, d, q4 ? m : d, xsum, n0 + i, q4) : (v16f){0};
    const v16f sums = transpose_sum(p);
    for (int64_t i = 0; i < rows; i++) out[n0 + i] = sums[i];
  }
}

static void q4_one_row(const float* x, int64_t K, const uint8_t* qs, const float* d, const float* m, int64_t N,
                       float* out, int num_threads) {
  one_row(x, K, qs, d, m, N, out, num_threads, 1);
}

static void q8_0_one_row(const float* x, int64_t K, const int8_t* qs, const float* d, int64_t N, float* out,
                         int num_threads) {
  one_row(x, K, qs, d, NULL, N, out, num_threads, 0);
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
