/* Paged decode attention on the CPU, reading K/V in place through the block table.
 *
 * The model: a query is a sequence's last nq (1..8) tokens -- a decode is one, a speculative verify
 * step 1 + K -- and token t sees the keys up to its own position. One work item per query (or per
 * (query, KV head) when there are fewer queries than two per thread) walks the sequence's blocks in
 * order and, within a block, its KV heads one after the other, 16 tokens at a time; each of its
 * tokens' G = H / KVH query heads per KV head (GQA) score the keys (q . k * scale, the 16 dot
 * products reduced together by one transpose-and-add), update a running maximum and sum (online
 * softmax, as flash attention does) and accumulate the values, rescaled whenever the maximum grows.
 * Every K/V byte of the sequence is read once per query, straight from the cache: no gathered copy,
 * no padding to the batch's longest sequence, no mask. Why per query: a block's rows of all KV heads
 * are one contiguous [block_size, KVH, D] run, so an item reads front to back, and the next block's
 * rows are prefetched into L2 while this one computes. On a 2-core Zen 5 VM at 8 sequences x 400
 * tokens (30 layers, K/V from DRAM) that took a step's attention from 26 to 14 ms; a plain read of
 * the same blocks in (sequence, KV head) order runs at 7 GB/s, in sequence order 11, with the L2
 * prefetch 16 (a linear stream: 22). A verify step's 4 tokens used to be 4 decodes reading the K/V
 * 4 times (1,000-token context: 12 -> 5.x ms over 30 layers, see docs/performance.md).
 * Layout: kv_cache [2, num_blocks, block_size, KVH, D] float32 (K then V); query / out [T, H, D];
 * query c is rows [token_starts[c], + num_tokens[c]) of query / out, of sequence seq_rows[c] (its row
 * of block_tables [num_seqs, max_blocks] int32 and seq_lens [num_seqs] int32). D must be a multiple
 * of 16.
 */
#include "attention_common.h"

#define MAX_QUERY_TOKENS 8  /* tokens of one query (a verify step's 1 + K, a prefill's tail) */
#define MAX_SLOTS 24  /* (KV head, token) pairs one work item carries state for */

/* acc[h] += sum_t probs[h][t] v_t over the n values at v; unrolled for a full chunk. */
INLINE void accumulate_values(v16f acc[][MAX_VECS], const float probs[][CHUNK], const float* v, int64_t stride,
                              int64_t n, const int G, const int V) {
  if (n == CHUNK) {
    for (int t = 0; t < CHUNK; t++)
      for (int c = 0; c < V; c++) {
        const v16f vc = load16(v + t * stride + 16 * c);
        for (int h = 0; h < G; h++) acc[h][c] += probs[h][t] * vc;
      }
    return;
  }
  for (int64_t t = 0; t < n; t++)
    for (int c = 0; c < V; c++) {
      const v16f vc = load16(v + t * stride + 16 * c);
      for (int h = 0; h < G; h++) acc[h][c] += probs[h][t] * vc;
    }
}

/* Ask for a block's K and V rows of KV heads [kvh0, kvh0 + nkvh) into L2, where `part` of `parts`
 * of them: spread over the work of the block before, the requests overlap its compute. (Into L1
 * instead, the prefetches waited on the few L1 miss buffers and gained nothing.) */
INLINE void prefetch_block(const float* k, const float* v, int64_t row_floats, int64_t rows, int64_t stride,
                           int64_t part, int64_t parts) {
  const int64_t lines_per_row = (row_floats + 15) / 16, lines = rows * lines_per_row;
  for (int64_t i = part * lines / parts; i < (part + 1) * lines / parts; i++) {
    const int64_t offset = (i / lines_per_row) * stride + (i % lines_per_row) * 16;
    __builtin_prefetch(k + offset, 0, 2), __builtin_prefetch(v + offset, 0, 2);
  }
}

/* One slot's G query heads over the n keys at k / v: score, online-softmax update, accumulate. The
 * accumulators are copied into locals so GCC keeps them in registers for the chunk. */
INLINE void attend_chunk(const int G, const int V, const v16f qv[][V], v16f acc[][V], float* running_max,
                         float* running_sum, const float* k, const float* v, int64_t stride, int64_t n) {
  float probs[G][CHUNK] __attribute__((aligned(64)));
  v16f a[G][MAX_VECS];
  for (int h = 0; h < G; h++)
    for (int c = 0; c < V; c++) a[h][c] = acc[h][c];
  for (int h = 0; h < G; h++) {
    const v16f scores = score_chunk(qv[h], k, stride, n, V);
    const float chunk_max = hmax(scores), old_max = running_max[h];
    float new_max = old_max;
    if (chunk_max > old_max) {  /* rescale what was summed so far; rarer as the sequence goes on */
      new_max = chunk_max;
      const float correction = exp16(splat(old_max - new_max))[0];  /* 0 on the first chunk */
      running_max[h] = new_max, running_sum[h] *= correction;
      for (int c = 0; c < V; c++) a[h][c] *= correction;
    }
    const v16f p = exp16(scores - new_max);  /* lanes >= n: e^-inf = 0 */
    running_sum[h] += hsum16(p);
    memcpy(probs[h], &p, sizeof p);
  }
  accumulate_values(a, probs, v, stride, n, G, V);
  for (int h = 0; h < G; h++)
    for (int c = 0; c < V; c++) acc[h][c] = a[h][c];
}

/* KV heads [kvh0, kvh0 + nkvh) of one query's nq tokens (the sequence's last nq positions: token t
 * sees seq_len - nq + 1 + t keys), each KV head with its G query heads; q / out point at token 0's
 * first query head of KV head kvh0 (token stride `row`). Block by block, and within a block KV head
 * by KV head, so one item reads each block's rows of its heads front to back -- with every KV head in
 * one item, a contiguous [block_size, KVH, D] run -- and once for all nq tokens (a speculative verify
 * step's 1 + K), which score it from L1. State: slot = (KV head j, token t). */
INLINE void attend(const float* q, float* out, int64_t row, int64_t nq, const float* k_cache, const float* v_cache,
                   const int32_t* blocks, int64_t seq_len, int64_t kvh0, int64_t nkvh, Geometry g, float scale,
                   const int G, const int V) {
  const int64_t stride = g.num_kv_heads * g.head_dim, bs = g.block_size;
  v16f acc[MAX_SLOTS][G][V], qv[MAX_SLOTS][G][V];
  float running_max[MAX_SLOTS][G], running_sum[MAX_SLOTS][G];
  for (int64_t j = 0; j < nkvh; j++)
    for (int64_t t = 0; t < nq; t++)
      for (int h = 0; h < G; h++) {
        const int64_t slot = j * nq + t;
        running_max[slot][h] = -INFINITY, running_sum[slot][h] = 0.0f;
        for (int c = 0; c < V; c++)
          acc[slot][h][c] = (v16f){0}, qv[slot][h][c] = load16(q + t * row + (j * G + h) * g.head_dim + 16 * c) * scale;
      }
  const int64_t num_blocks = (seq_len + bs - 1) / bs;
  for (int64_t b = 0; b < num_blocks; b++) {
    const float* kb = k_cache + ((int64_t)blocks[b] * bs * g.num_kv_heads + kvh0) * g.head_dim;
    const float* vb = v_cache + (kb - k_cache);
    const float* next_k = b + 1 < num_blocks ? k_cache + ((int64_t)blocks[b + 1] * bs * g.num_kv_heads + kvh0) * g.head_dim : NULL;
    const int64_t block_len = seq_len - b * bs < bs ? seq_len - b * bs : bs;
    const int64_t next_len = seq_len - (b + 1) * bs < bs ? seq_len - (b + 1) * bs : bs;
    /* chunks never cross a block: CHUNK tokens, or what is left of the block */
    for (int64_t in_block = 0; in_block < block_len; in_block += CHUNK) {
      const int64_t start = b * bs + in_block, chunk = block_len - in_block < CHUNK ? block_len - in_block : CHUNK;
      for (int64_t j = 0; j < nkvh; j++) {
        if (next_k)
          prefetch_block(next_k, v_cache + (next_k - k_cache), nkvh * g.head_dim, next_len, stride,
                         in_block / CHUNK * nkvh + j, (block_len + CHUNK - 1) / CHUNK * nkvh);
        const float* k = kb + in_block * stride + j * g.head_dim;
        const float* v = vb + in_block * stride + j * g.head_dim;
        for (int64_t t = 0; t < nq; t++) {
          const int64_t slot = j * nq + t, keys = seq_len - nq + 1 + t;  /* token t's causal limit */
          if (start >= keys) continue;
          const int64_t n = keys - start < chunk ? keys - start : chunk;
          attend_chunk(G, V, qv[slot], acc[slot], running_max[slot], running_sum[slot], k, v, stride, n);
        }
      }
    }
  }
  for (int64_t j = 0; j < nkvh; j++)
    for (int64_t t = 0; t < nq; t++)
      for (int h = 0; h < G; h++)
        for (int c = 0; c < V; c++) {
          const int64_t slot = j * nq + t;
          const v16f o = acc[slot][h][c] / running_sum[slot][h];
          memcpy(out + t * row + (j * G + h) * g.head_dim + 16 * c, &o, sizeof o);
        }
}

/* Specialized copies for the common (GQA group, head_dim) pairs; anything else runs the generic one. */
#define CASE(GG, VV) if (G == GG && V == VV) { attend(q, o, row, nq, k, v, blocks, len, kvh, nkvh, geo, scale, GG, VV); return; }
static void attend_any(const float* q, float* o, int64_t row, int64_t nq, const float* k, const float* v,
                       const int32_t* blocks, int64_t len, int64_t kvh, int64_t nkvh, Geometry geo, float scale) {
  const int G = (int)(geo.num_heads / geo.num_kv_heads), V = (int)(geo.head_dim / 16);
  CASE(1, 4) CASE(2, 4) CASE(3, 4) CASE(4, 4) CASE(6, 4) CASE(8, 4)
  CASE(1, 8) CASE(2, 8) CASE(3, 8) CASE(4, 8) CASE(6, 8) CASE(8, 8)
  attend(q, o, row, nq, k, v, blocks, len, kvh, nkvh, geo, scale, G, V);
}

/* Query c is rows [token_starts[c], + num_tokens[c]) of query / out (1 <= num_tokens <= MAX_QUERY_TOKENS;
 * a plain decode is one token), the last positions of sequence seq_rows[c]. Returns 0, or 1 for a
 * geometry or query length the kernel does not take. */
int paged_decode_attention(const float* query, const float* kv_cache, const int64_t* token_starts,
                           const int64_t* num_tokens, const int64_t* seq_rows, const int32_t* block_tables,
                           int64_t max_blocks, const int32_t* seq_lens, int64_t num_queries, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t num_blocks, float scale,
                           float* out, int num_threads) {
  if (head_dim % 16 || head_dim > 16 * MAX_VECS || num_heads % num_kv_heads || num_heads / num_kv_heads > MAX_GROUP)
    return 1;
  int64_t longest = 1;
  for (int64_t c = 0; c < num_queries; c++) {
    if (num_tokens[c] < 1 || num_tokens[c] > MAX_QUERY_TOKENS) return 1;
    longest = num_tokens[c] > longest ? num_tokens[c] : longest;
  }
  const Geometry g = {num_heads, num_kv_heads, head_dim, block_size, num_blocks};
  const float* v_cache = kv_cache + num_blocks * block_size * num_kv_heads * head_dim;
  const int64_t G = num_heads / num_kv_heads, row = num_heads * head_dim;
  /* One item per query walks all its KV heads (contiguous rows) where its slots fit -- else the largest
   * divisor of KVH that fits; with fewer queries than two per thread, one item per (query, KV head)
   * keeps the threads busy. */
  int64_t per_item = 1;
  if (num_queries >= 2 * num_threads)
    for (int64_t d = num_kv_heads; d > 1; d--)
      if (num_kv_heads % d == 0 && d * longest <= MAX_SLOTS) { per_item = d; break; }
  const int64_t items_per_query = num_kv_heads / per_item;
  #pragma omp parallel for schedule(dynamic) num_threads(num_threads)
  for (int64_t item = 0; item < num_queries * items_per_query; item++) {
    const int64_t c = item / items_per_query, kvh = item % items_per_query * per_item;
    const int64_t offset = token_starts[c] * row + kvh * G * head_dim;
    attend_any(query + offset, out + offset, row, num_tokens[c], kv_cache, v_cache,
               block_tables + seq_rows[c] * max_blocks, seq_lens[seq_rows[c]], kvh, per_item, g, scale);
  }
  return 0;
}
