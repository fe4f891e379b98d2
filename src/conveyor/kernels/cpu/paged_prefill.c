/* Paged prefill attention on the CPU: causal attention of a prefill chunk's query tokens over their
 * sequence's cached keys (the context before the chunk and the chunk itself), read in place.
 *
 * The model: one work item per (chunk, KV head, tile of QT consecutive query tokens). The tile's
 * QT x G query vectors (G = H / KVH query heads per KV head, GQA) walk the keys up to the tile's last
 * position once, 16 at a time within a block, so each key and value row is loaded once per tile and
 * reused by all its query vectors (from L1). Per chunk of keys, each query vector scores the keys
 * (16 dot products reduced by one transpose-and-add), masks those after its own position (causal),
 * and updates its online softmax (running maximum and sum, the accumulator rescaled when the maximum
 * grows); the values are then accumulated for groups of query vectors whose accumulators fit in
 * registers. No gathered copy of K/V, no [q, L] mask tensor, and the keys after a tile's last token
 * are never read: causal work only, also after a cached context.
 * Layout as paged_attention.c; chunk c's query tokens are rows [token_starts[c], + num_tokens[c]) of
 * query / out, its sequence row seq_rows[c] of block_tables / seq_lens, its tokens the last
 * num_tokens[c] of seq_lens[seq_rows[c]] positions.
 */
#include <stdlib.h>

#include "attention_common.h"

#define QT 16  /* query tokens per work item: QT G rows, a multiple of 16 for the softmax groups */
#define SCORE_ROWS 4  /* query vectors scored together (each key vector loaded once for them) */

typedef struct {
  int64_t chunk, kvh, first;  /* tile tokens [first, first + QT) of the chunk */
} Tile;

/* acc[r] = acc[r] correction[r] + sum_t probs[r][t] v_t for query vectors [r0, r0 + RG): RG x V
 * accumulators in registers. */
INLINE void accumulate_group(float* acc, const float probs[][CHUNK], const float* correction, int64_t r0,
                             const float* v, int64_t stride, int64_t n, const int RG, const int V) {
  v16f a[RG][V];  /* acc: [rows, V * 16], first rescaled by the softmax step's correction */
  for (int j = 0; j < RG; j++)
    for (int c = 0; c < V; c++) a[j][c] = load16(acc + (r0 + j) * V * 16 + 16 * c) * correction[r0 + j];
  for (int64_t t = 0; t < n; t++)
    for (int c = 0; c < V; c++) {
      const v16f vc = load16(v + t * stride + 16 * c);
      for (int j = 0; j < RG; j++) a[j][c] += probs[r0 + j][t] * vc;
    }
  for (int j = 0; j < RG; j++)
    for (int c = 0; c < V; c++) memcpy(acc + (r0 + j) * V * 16 + 16 * c, &a[j][c], sizeof a[j][c]);
}

/* r[t][j] -> r[j][t] in place: 4 butterfly rounds, in round w rows i and i + w swapping their w-wide
 * off-diagonal parts (16 two-source shuffles a round). */
INLINE void transpose16(v16f r[16]) {
  for (int i = 0; i < 16; i++)
    if (!(i & 8)) {
      const v16f a = r[i], b = r[i + 8];
      r[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
      r[i + 8] = __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    }
  for (int i = 0; i < 16; i++)
    if (!(i & 4)) {
      const v16f a = r[i], b = r[i + 4];
      r[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
      r[i + 4] = __builtin_shufflevector(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    }
  for (int i = 0; i < 16; i++)
    if (!(i & 2)) {
      const v16f a = r[i], b = r[i + 2];
      r[i] = __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
      r[i + 2] = __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    }
  for (int i = 0; i < 16; i++)
    if (!(i & 1)) {
      const v16f a = r[i], b = r[i + 1];
      r[i] = __builtin_shufflevector(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
      r[i + 1] = __builtin_shufflevector(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    }
}

/* kt [16 V][16] = the chunk's n keys at k (row stride `stride`) transposed, dimension-major with one
 * lane per key; keys >= n are zero (their scores are masked). */
INLINE void transpose_keys(const float* k, int64_t stride, int64_t n, float* kt, const int V) {
  for (int c = 0; c < V; c++) {
    v16f r[16];
    for (int t = 0; t < 16; t++) r[t] = t < n ? load16(k + t * stride + 16 * c) : (v16f){0};
    transpose16(r);
    for (int j = 0; j < 16; j++) memcpy(kt + (16 * c + j) * 16, &r[j], sizeof r[j]);
  }
}

/* scores[j] (lane t = q_(r0+j) . k_t) for NR query vectors of qs [rows, 16 V] against kt: each key
 * vector loaded once for the NR rows, two accumulators per row to halve the FMA chain. */
INLINE void score_rows(const float* qs, int64_t r0, const float* kt, v16f* scores, const int NR, const int V) {
  v16f s[NR][2];
  for (int j = 0; j < NR; j++) s[j][0] = s[j][1] = (v16f){0};
  for (int d = 0; d < 16 * V; d += 2) {
    const v16f k0 = load16(kt + d * 16), k1 = load16(kt + (d + 1) * 16);
    for (int j = 0; j < NR; j++) {
      const float* q = qs + (r0 + j) * 16 * V + d;
      s[j][0] += q[0] * k0, s[j][1] += q[1] * k1;
    }
  }
  for (int j = 0; j < NR; j++) scores[j] = s[j][0] + s[j][1];
}

/* The online-softmax step of 16 query vectors [r0, r0 + 16) on their masked scores s[16]: the row
 * maxima, the rescale factors and the row sums each come out as one vector (transpose-and-reduce),
 * one exp16 covers the 16 rescale factors, and the rescale of the accumulators is left to
 * accumulate_group (correction[r]), so no branch depends on the data. probs[r] = e^(s - max). */
INLINE void softmax_rows(v16f s[16], int64_t r0, float* running_max, float* running_sum, float* correction,
                         float probs[][CHUNK]) {
  const v16f old_max = load16(running_max + r0), new_max = vmax(old_max, transpose_max(s));
  const v16f rescale = exp16(old_max - new_max);  /* 0 on the first chunk (old max -inf) */
  for (int j = 0; j < 16; j++) {
    s[j] = exp16(s[j] - new_max[j]);  /* masked lanes: e^-inf = 0 */
    memcpy(probs[r0 + j], &s[j], sizeof s[j]);
  }
  const v16f sums = load16(running_sum + r0) * rescale + transpose_sum(s);
  memcpy(running_max + r0, &new_max, sizeof new_max), memcpy(running_sum + r0, &sums, sizeof sums);
  memcpy(correction + r0, &rescale, sizeof rescale);
}

/* One tile: nq tokens at absolute positions first_pos.., rows q / out (row stride H * D, this KV
 * head's first query head). */
INLINE void prefill_tile(const float* q, float* out, int64_t nq, int64_t first_pos, const float* k_cache,
                         const float* v_cache, const int32_t* blocks, int64_t kvh, Geometry g, float scale,
                         const int G, const int V) {
  const int RG = V <= 4 ? 4 : 2;  /* query vectors per value group (divides 16): RG x V accumulators + V values */
  const int64_t stride = g.num_kv_heads * g.head_dim, row = g.num_heads * g.head_dim, bs = g.block_size;
  const int64_t rows = nq * G, num_keys = first_pos + nq, padded = (rows + 15) / 16 * 16;
  float qs[QT * G][16 * V] __attribute__((aligned(64)));  /* scaled queries; rows past `rows` zero */
  float acc[QT * G][16 * V] __attribute__((aligned(64)));
  float probs[QT * G][CHUNK] __attribute__((aligned(64)));
  float kt[16 * V][CHUNK] __attribute__((aligned(64)));
  float running_max[QT * G] __attribute__((aligned(64))), running_sum[QT * G] __attribute__((aligned(64)));
  float correction[QT * G] __attribute__((aligned(64)));
  memset(qs, 0, sizeof qs), memset(acc, 0, sizeof acc), memset(running_sum, 0, sizeof running_sum);
  for (int64_t r = 0; r < QT * G; r++) running_max[r] = -INFINITY;
  for (int64_t r = 0; r < rows; r++)  /* r = token i, head h: r = i G + h */
    for (int64_t e = 0; e < 16 * V; e++) qs[r][e] = q[(r / G) * row + (r % G) * g.head_dim + e] * scale;
  v16f lane;
  for (int t = 0; t < CHUNK; t++) lane[t] = (float)t;
  for (int64_t start = 0; start < num_keys;) {
    const int64_t in_block = start % bs, left = num_keys - start;
    const int64_t n = left < CHUNK && left < bs - in_block ? left : (CHUNK < bs - in_block ? CHUNK : bs - in_block);
    const float* k = k_cache + (((int64_t)blocks[start / bs] * bs + in_block) * g.num_kv_heads + kvh) * g.head_dim;
    transpose_keys(k, stride, n, &kt[0][0], V);
    const v16f key_pos = lane + (float)start, past_end = splat((float)(start + n));
    for (int64_t r0 = 0; r0 < padded; r0 += 16) {  /* QT G is a multiple of 16; padding rows are zero */
      v16f scores[16];
      for (int j = 0; j < 16; j += SCORE_ROWS) score_rows(&qs[0][0], r0 + j, &kt[0][0], scores + j, SCORE_ROWS, V);
      for (int j = 0; j < 16; j++) {  /* causal: key positions after the row's token are -inf */
        const float pos = (float)(first_pos + (r0 + j) / G);
        scores[j] = vselect((key_pos <= pos) & (key_pos < past_end), scores[j], splat(-INFINITY));
      }
      softmax_rows(scores, r0, running_max, running_sum, correction, probs);
    }
    const float* v = v_cache + (k - k_cache);
    for (int64_t r0 = 0; r0 < padded; r0 += RG) accumulate_group(&acc[0][0], probs, correction, r0, v, stride, n, RG, V);
    start += n;
  }
  for (int64_t r = 0; r < rows; r++)
    for (int c = 0; c < V; c++) {
      const v16f o = load16(&acc[r][16 * c]) / running_sum[r];
      memcpy(out + (r / G) * row + (r % G) * g.head_dim + 16 * c, &o, sizeof o);
    }
}

#define CASE(GG, VV) if (G == GG && V == VV) { prefill_tile(q, o, nq, pos, k, v, blocks, kvh, geo, scale, GG, VV); return; }
static void prefill_tile_any(const float* q, float* o, int64_t nq, int64_t pos, const float* k, const float* v,
                             const int32_t* blocks, int64_t kvh, Geometry geo, float scale) {
  const int G = (int)(geo.num_heads / geo.num_kv_heads), V = (int)(geo.head_dim / 16);
  CASE(1, 4) CASE(2, 4) CASE(3, 4) CASE(4, 4) CASE(6, 4) CASE(8, 4)
  CASE(1, 8) CASE(2, 8) CASE(3, 8) CASE(4, 8) CASE(6, 8) CASE(8, 8)
  prefill_tile(q, o, nq, pos, k, v, blocks, kvh, geo, scale, G, V);
}

/* Returns 0, 1 for a geometry the kernel does not take, 2 where the tile list could not be allocated. */
int paged_prefill_attention(const float* query, const float* kv_cache, const int64_t* token_starts,
                            const int64_t* num_tokens, const int64_t* seq_rows, const int32_t* block_tables,
                            int64_t max_blocks, const int32_t* seq_lens, int64_t num_chunks, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t num_blocks,
                            float scale, float* out, int num_threads) {
  if (head_dim % 16 || head_dim > 16 * MAX_VECS || num_heads % num_kv_heads || num_heads / num_kv_heads > MAX_GROUP)
    return 1;
  int64_t num_tiles = 0;
  for (int64_t c = 0; c < num_chunks; c++) num_tiles += (num_tokens[c] + QT - 1) / QT * num_kv_heads;
  Tile* tiles = malloc((num_tiles ? num_tiles : 1) * sizeof(Tile));
  if (!tiles) return 2;
  int64_t i = 0;  /* the last tiles of each chunk first: they see the most keys (dynamic scheduling) */
  for (int64_t c = 0; c < num_chunks; c++)
    for (int64_t first = (num_tokens[c] - 1) / QT * QT; first >= 0; first -= QT)
      for (int64_t kvh = 0; kvh < num_kv_heads; kvh++) tiles[i++] = (Tile){c, kvh, first};
  const Geometry g = {num_heads, num_kv_heads, head_dim, block_size, num_blocks};
  const float* v_cache = kv_cache + num_blocks * block_size * num_kv_heads * head_dim;
  const int64_t G = num_heads / num_kv_heads;
  #pragma omp parallel for schedule(dynamic) num_threads(num_threads)
  for (int64_t t = 0; t < num_tiles; t++) {
    const Tile tile = tiles[t];
    const int64_t nq_chunk = num_tokens[tile.chunk], seq = seq_rows[tile.chunk];
    const int64_t nq = nq_chunk - tile.first < QT ? nq_chunk - tile.first : QT;
    const int64_t first_pos = seq_lens[seq] - nq_chunk + tile.first;
    const int64_t offset = (token_starts[tile.chunk] + tile.first) * num_heads * head_dim + tile.kvh * G * head_dim;
    prefill_tile_any(query + offset, out + offset, nq, first_pos, kv_cache, v_cache,
                     block_tables + seq * max_blocks, tile.kvh, g, scale);
  }
  free(tiles);
  return 0;
}
