/* Paged prefill attention on the CPU: causal attention of a prefill chunk's query tokens over their
 * sequence's cached keys (the context before the chunk and the chunk itself), read in place.
 *
 * The model: one work item per (chunk, KV head, tile of QT = ROWS / G consecutive query tokens). The
 * tile's ROWS query vectors (row r = token r / G, head r % G of the KV head's G = H / KVH, GQA) sit
 * in vector lanes, 16 rows a vector, RV vectors: queries transposed once per tile to qt[dim][row],
 * the output accumulated as ot[dim][row] and transposed back once at the end. The tile walks the keys
 * up to its last position once, KC at a time (an online-softmax step), each key and value row loaded
 * once per tile and shared by all its rows. In this layout every step is a lane-wise vector op:
 * scores s[key][rows] = sum_d k[key][d] (broadcast) * qt[d][rows], KB keys x RV vectors of
 * accumulators in registers; the row maxima, exponentials and sums across keys need no transpose or
 * horizontal reduction; values accumulate as ot[d][rows] += v[key][d] (broadcast) * p[key][rows],
 * DB dimensions x RV vectors in registers, rescaled once per step. So the loops are broadcast FMAs
 * plus one exp per (row, key), and the causal mask is applied only to the key blocks that reach past
 * the tile's first position. Keys are addressed through a per-step table of row pointers, so a step
 * may span KV blocks of any size; keys after a tile's last token are never read, also after a cached
 * context. No gathered copy of K/V, no [q, L] mask tensor.
 * Layout as paged_attention.c; chunk c's query tokens are rows [token_starts[c], + num_tokens[c]) of
 * query / out, its sequence row seq_rows[c] of block_tables / seq_lens, its tokens the last
 * num_tokens[c] of seq_lens[seq_rows[c]] positions.
 */
#include <stdlib.h>

#include "attention_common.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* Lane-wise maximum: one vmaxps with AVX-512 (vmax's compare and select is three instructions). */
INLINE v16f max16(v16f a, v16f b) {
#ifdef __AVX512F__
  return (v16f)_mm512_max_ps((__m512)a, (__m512)b);
#else
  return vmax(a, b);
#endif
}

#define ROWS 48  /* query vectors per tile (a multiple of 16, >= MAX_GROUP) */
#define RV (ROWS / 16)  /* vectors of rows */
#define KC 32  /* keys per online-softmax step */
#define KB 8  /* keys scored together: KB x RV score accumulators, KC a multiple */
#define DB 8  /* value dimensions accumulated together: DB x RV accumulators, 16 a multiple */

typedef struct {
  int64_t chunk, kvh, first;  /* tile tokens [first, first + QT) of the chunk */
} Tile;

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

/* Row x of a tile is token x / G, head x % G: offset[x] its offset in q / out (row stride `row`,
 * head_dim D) and pos[x] its position (first_pos + x / G), for the `rows` real rows; padding rows
 * take the last real row's position, so their scores stay finite. Counted up: no divisions. */
INLINE void tile_rows(int64_t rows, int64_t G, int64_t row, int64_t D, int64_t first_pos, int64_t* offset,
                      v16i* pos) {
  for (int64_t x = 0, token = 0, head = 0; x < ROWS; x++) {
    if (x < rows) offset[x] = token * row + head * D;
    pos[x / 16][x % 16] = (int32_t)(first_pos + token);
    if (x + 1 < rows && ++head == G) head = 0, token++;
  }
}

/* qt[d][x] = scale q_x[d] for the tile's `rows` query vectors at q + offset[x], zero for the
 * padding rows: 16 x 16 blocks transposed in registers. */
INLINE void load_queries(const float* q, const int64_t* offset, int64_t rows, float scale, float* qt, const int V) {
  for (int j = 0; j < RV; j++)
    for (int c = 0; c < V; c++) {
      v16f r[16];
      for (int i = 0; i < 16; i++) {
        const int64_t x = 16 * j + i;
        r[i] = x < rows ? load16(q + offset[x] + 16 * c) * scale : (v16f){0};
      }
      transpose16(r);
      for (int i = 0; i < 16; i++) memcpy(qt + (16 * c + i) * ROWS + 16 * j, &r[i], sizeof r[i]);
    }
}

/* s[t] = the rows' scores of keys [t0, t0 + KB) (key t at k[t]), -inf where key_pos0 + t is after
 * the row's position (only when `masked`: the block reaches past the tile's first position), folded
 * into the step's row maxima m. */
INLINE void score_block(const float* qt, const float* const* k, int t0, int64_t key_pos0, const v16i* row_pos,
                        int masked, float* s, v16f* m, const int V) {
  v16f a[KB][RV];
  for (int t = 0; t < KB; t++)
    for (int j = 0; j < RV; j++) a[t][j] = (v16f){0};
  const float* kt[KB];
  for (int t = 0; t < KB; t++) kt[t] = k[t0 + t];
  for (int d = 0; d < 16 * V; d++) {
    v16f qd[RV];
    for (int j = 0; j < RV; j++) qd[j] = load16(qt + d * ROWS + 16 * j);
    for (int t = 0; t < KB; t++)
      for (int j = 0; j < RV; j++) a[t][j] += kt[t][d] * qd[j];
  }
  for (int t = 0; t < KB; t++)
    for (int j = 0; j < RV; j++) {
      if (masked) a[t][j] = vselect((v16i){0} + (int32_t)(key_pos0 + t) <= row_pos[j], a[t][j], splat(-INFINITY));
      m[j] = max16(m[j], a[t][j]);
      memcpy(s + (t0 + t) * ROWS + 16 * j, &a[t][j], sizeof a[t][j]);
    }
}

/* e^x for x <= 0 or -inf (a score minus its row maximum), 16 lanes: exp16's Cephes polynomial (Horner)
 * with half its instructions, which matters at one exp per (row, key). The 1.5 2^23 + 127 shift
 * rounds x log2(e) to the nearest n and leaves n + 127, the exponent of 2^n, in the low mantissa
 * bits; x clamped at -88 makes that 0 (2^n = 0) for e^x < 2^-126, -inf included. */
INLINE v16f exp_nonpositive16(v16f x) {
  const float shift = 12582912.0f + 127.0f;
  x = max16(x, splat(-88.0f));
  const v16f shifted = x * 1.44269504088896341f + shift, n = shifted - shift;
  const v16f r = x - n * 0.693359375f + n * 2.12194440e-4f;
  v16f y = splat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r + 1.0f;
  y = y * r + 1.0f;
  v16i bits;
  memcpy(&bits, &shifted, sizeof bits);
  bits <<= 23;
  v16f scale;
  memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

/* The online-softmax step over nk scored keys s (their row maxima m): s becomes the probabilities
 * e^(s - max), the running maxima and sums move on, and rescale is the factor of the accumulators
 * (0 on the first step: old maximum -inf). Lane-wise, so no branch depends on the data. */
INLINE void softmax_step(float* s, int nk, const v16f* m, v16f* max, v16f* sum, v16f* rescale) {
  v16f total[RV];
  for (int j = 0; j < RV; j++) {
    const v16f new_max = max16(max[j], m[j]);
    rescale[j] = exp_nonpositive16(max[j] - new_max), max[j] = new_max, total[j] = (v16f){0};
  }
  for (int t = 0; t < nk; t++)
    for (int j = 0; j < RV; j++) {
      const v16f p = exp_nonpositive16(load16(s + t * ROWS + 16 * j) - max[j]);  /* masked: e^-inf = 0 */
      memcpy(s + t * ROWS + 16 * j, &p, sizeof p), total[j] += p;
    }
  for (int j = 0; j < RV; j++) sum[j] = sum[j] * rescale[j] + total[j];
}

/* ot[d][rows] = ot[d][rows] rescale + sum_t v_t[d] p[t][rows] for dimensions [d0, d0 + DB) and the
 * n keys whose values are at k[t] + v_offset: DB x RV accumulators in registers. */
INLINE void accumulate_block(float* ot, const float* p, const float* const* k, int64_t v_offset, int n, int d0,
                             const v16f* rescale) {
  v16f a[DB][RV];
  for (int i = 0; i < DB; i++)
    for (int j = 0; j < RV; j++) a[i][j] = load16(ot + (d0 + i) * ROWS + 16 * j) * rescale[j];
  for (int t = 0; t < n; t++) {
    const float* v = k[t] + v_offset + d0;
    v16f pt[RV];
    for (int j = 0; j < RV; j++) pt[j] = load16(p + t * ROWS + 16 * j);
    for (int i = 0; i < DB; i++)
      for (int j = 0; j < RV; j++) a[i][j] += v[i] * pt[j];
  }
  for (int i = 0; i < DB; i++)
    for (int j = 0; j < RV; j++) memcpy(ot + (d0 + i) * ROWS + 16 * j, &a[i][j], sizeof a[i][j]);
}

/* out[x] = ot[.][x] / sum[x] for the tile's `rows` rows (layout as load_queries). */
INLINE void store_rows(const float* ot, const v16f* sum, const int64_t* offset, int64_t rows, float* out,
                       const int V) {
  for (int j = 0; j < RV; j++) {
    const v16f inv = 1.0f / sum[j];
    for (int c = 0; c < V; c++) {
      v16f r[16];
      for (int i = 0; i < 16; i++) r[i] = load16(ot + (16 * c + i) * ROWS + 16 * j) * inv;
      transpose16(r);
      for (int i = 0; i < 16 && 16 * j + i < rows; i++) memcpy(out + offset[16 * j + i] + 16 * c, &r[i], sizeof r[i]);
    }
  }
}

/* k[t] = key start + t's row in k_cache for t < n (blocks: the sequence's block table, block size bs,
 * `stride` floats a token, this KV head's `head` offset), k[n - 1] for t in [n, nk) (masked keys
 * still read a valid row). Walks the blocks: no division per key. */
INLINE void key_rows(const float** k, const float* k_cache, const int32_t* blocks, int64_t bs, int64_t stride,
                     int64_t head, int64_t start, int n, int nk) {
  int64_t block = start / bs, in_block = start % bs;
  for (int t = 0; t < n; t++) {
    k[t] = k_cache + ((int64_t)blocks[block] * bs + in_block) * stride + head;
    if (++in_block == bs) block++, in_block = 0;
  }
  for (int t = n; t < nk; t++) k[t] = k[n - 1];
}

/* One tile: nq tokens at absolute positions first_pos.., rows q / out (row stride H * D, this KV
 * head's first query head). */
INLINE void prefill_tile(const float* q, float* out, int64_t nq, int64_t first_pos, const float* k_cache,
                         const float* v_cache, const int32_t* blocks, int64_t kvh, Geometry g, float scale,
                         const int V) {
  const int64_t G = g.num_heads / g.num_kv_heads, row = g.num_heads * g.head_dim, bs = g.block_size;
  const int64_t rows = nq * G, num_keys = first_pos + nq, v_offset = v_cache - k_cache;
  float qt[16 * V * ROWS] __attribute__((aligned(64)));
  float ot[16 * V * ROWS] __attribute__((aligned(64)));
  float s[KC * ROWS] __attribute__((aligned(64)));  /* a step's scores, then its probabilities */
  const float* k[KC];  /* the step's key rows */
  int64_t offset[ROWS];
  v16i row_pos[RV];
  tile_rows(rows, G, row, g.head_dim, first_pos, offset, row_pos);
  load_queries(q, offset, rows, scale, qt, V);
  memset(ot, 0, sizeof ot);
  v16f max[RV], sum[RV], rescale[RV];
  for (int j = 0; j < RV; j++) max[j] = splat(-INFINITY), sum[j] = (v16f){0};
  for (int64_t start = 0; start < num_keys; start += KC) {
    const int n = num_keys - start < KC ? (int)(num_keys - start) : KC, nk = (n + KB - 1) / KB * KB;
    key_rows(k, k_cache, blocks, bs, g.num_kv_heads * g.head_dim, kvh * g.head_dim, start, n, nk);
    v16f m[RV];
    for (int j = 0; j < RV; j++) m[j] = splat(-INFINITY);
    for (int t0 = 0; t0 < nk; t0 += KB)
      score_block(qt, k, t0, start + t0, row_pos, start + t0 + KB - 1 > first_pos, s, m, V);
    softmax_step(s, nk, m, max, sum, rescale);
    for (int d0 = 0; d0 < 16 * V; d0 += DB) accumulate_block(ot, s, k, v_offset, n, d0, rescale);
  }
  store_rows(ot, sum, offset, rows, out, V);
}

static void prefill_tile_any(const float* q, float* o, int64_t nq, int64_t pos, const float* k, const float* v,
                             const int32_t* blocks, int64_t kvh, Geometry geo, float scale) {
  const int V = (int)(geo.head_dim / 16);
  if (V == 4) prefill_tile(q, o, nq, pos, k, v, blocks, kvh, geo, scale, 4);
  else if (V == 8) prefill_tile(q, o, nq, pos, k, v, blocks, kvh, geo, scale, 8);
  else prefill_tile(q, o, nq, pos, k, v, blocks, kvh, geo, scale, V);
}

/* Returns 0, 1 for a geometry the kernel does not take, 2 where the tile list could not be allocated. */
int paged_prefill_attention(const float* query, const float* kv_cache, const int64_t* token_starts,
                            const int64_t* num_tokens, const int64_t* seq_rows, const int32_t* block_tables,
                            int64_t max_blocks, const int32_t* seq_lens, int64_t num_chunks, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t num_blocks,
                            float scale, float* out, int num_threads) {
  if (head_dim % 16 || head_dim > 16 * MAX_VECS || num_heads % num_kv_heads || num_heads / num_kv_heads > MAX_GROUP)
    return 1;
  const int64_t G = num_heads / num_kv_heads, QT = ROWS / G;
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
