/* Paged decode attention on the CPU, reading K/V in place through the block table.
 *
 * The model: one work item per (decode sequence, KV head). Its G = H / KVH query heads (GQA) walk
 * the sequence's blocks in order; per block they score the block's keys (q . k * scale), update a
 * running maximum and sum (online softmax, as flash attention does) and accumulate the values,
 * rescaled whenever the maximum grows. Every K/V byte of the sequence is read exactly once, straight
 * from the cache: no gathered copy, no padding to the batch's longest sequence, no mask.
 * Layout: kv_cache [2, num_blocks, block_size, KVH, D] float32 (K then V); query / out [T, H, D];
 * token_rows [S] (the decode tokens' rows in query / out), seq_rows [S] (their rows in block_tables
 * [num_seqs, max_blocks] int32 and seq_lens [num_seqs] int32). D must be a multiple of 16.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
#define INLINE static inline __attribute__((always_inline))
#define MAX_BLOCK_SIZE 256

INLINE v16f load16(const float* p) { v16f v; memcpy(&v, p, sizeof v); return v; }
INLINE float hsum(v16f v) { float s = 0.0f; for (int i = 0; i < 16; i++) s += v[i]; return s; }
INLINE v16f splat(float x) { return (v16f){0} + x; }

INLINE v16f select(v16i mask, v16f a, v16f b) {  /* lane-wise mask ? a : b (C has no vector ?:) */
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
  x = select(x < hi, x, hi);
  x = select(x > lo, x, lo);
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

typedef struct {
  int64_t num_heads, num_kv_heads, head_dim, block_size, num_blocks;
} Geometry;

/* One (sequence, KV head): G query heads at q (stride D), output to out (stride D). */
static void attend(const float* q, const float* k_cache, const float* v_cache, const int32_t* blocks,
                   int64_t seq_len, int64_t kvh, Geometry g, float scale, float* out) {
  const int64_t G = g.num_heads / g.num_kv_heads, V = g.head_dim / 16, token_stride = g.num_kv_heads * g.head_dim;
  v16f acc[G][V];
  float running_max[G], running_sum[G], scores[G][MAX_BLOCK_SIZE + 16];
  for (int64_t h = 0; h < G; h++) {
    running_max[h] = -INFINITY, running_sum[h] = 0.0f;
    for (int64_t c = 0; c < V; c++) acc[h][c] = (v16f){0};
  }
  for (int64_t start = 0; start < seq_len; start += g.block_size) {
    const int64_t n = seq_len - start < g.block_size ? seq_len - start : g.block_size;
    const int64_t base = ((int64_t)blocks[start / g.block_size] * g.block_size * g.num_kv_heads + kvh) * g.head_dim;
    for (int64_t t = 0; t < n; t++) {
      const float* k = k_cache + base + t * token_stride;
      for (int64_t h = 0; h < G; h++) {
        v16f dot = (v16f){0};
        for (int64_t c = 0; c < V; c++) dot += load16(q + h * g.head_dim + 16 * c) * load16(k + 16 * c);
        scores[h][t] = hsum(dot) * scale;
      }
    }
    for (int64_t h = 0; h < G; h++) {
      float block_max = running_max[h];
      for (int64_t t = 0; t < n; t++) block_max = scores[h][t] > block_max ? scores[h][t] : block_max;
      const float correction = expf(running_max[h] - block_max);  /* 0 on the first block */
      running_max[h] = block_max;
      running_sum[h] *= correction;
      for (int64_t c = 0; c < V; c++) acc[h][c] *= correction;
      for (int64_t t = 0; t < n; t += 16) {
        v16f p = exp16(load16(&scores[h][t]) - block_max);
        memcpy(&scores[h][t], &p, sizeof p);  /* lanes past n are never read */
      }
      for (int64_t t = 0; t < n; t++) running_sum[h] += scores[h][t];
    }
    for (int64_t t = 0; t < n; t++) {
      const float* v = v_cache + base + t * token_stride;
      for (int64_t c = 0; c < V; c++) {
        const v16f vc = load16(v + 16 * c);
        for (int64_t h = 0; h < G; h++) acc[h][c] += scores[h][t] * vc;
      }
    }
  }
  for (int64_t h = 0; h < G; h++)
    for (int64_t c = 0; c < V; c++) {
      const v16f o = acc[h][c] / running_sum[h];
      memcpy(out + h * g.head_dim + 16 * c, &o, sizeof o);
    }
}

int paged_decode_attention(const float* query, const float* kv_cache, const int64_t* token_rows,
                           const int64_t* seq_rows, const int32_t* block_tables, int64_t max_blocks,
                           const int32_t* seq_lens, int64_t num_decodes, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t block_size, int64_t num_blocks, float scale, float* out,
                           int num_threads) {
  if (head_dim % 16 || block_size > MAX_BLOCK_SIZE || num_heads % num_kv_heads) return 1;
  const Geometry g = {num_heads, num_kv_heads, head_dim, block_size, num_blocks};
  const float* v_cache = kv_cache + num_blocks * block_size * num_kv_heads * head_dim;
  const int64_t G = num_heads / num_kv_heads;
  #pragma omp parallel for schedule(dynamic) num_threads(num_threads)
  for (int64_t item = 0; item < num_decodes * num_kv_heads; item++) {
    const int64_t i = item / num_kv_heads, kvh = item % num_kv_heads;
    const int64_t row = token_rows[i] * num_heads * head_dim + kvh * G * head_dim;
    attend(query + row, kv_cache, v_cache, block_tables + seq_rows[i] * max_blocks, seq_lens[seq_rows[i]], kvh,
           g, scale, out + row);
  }
  return 0;
}
