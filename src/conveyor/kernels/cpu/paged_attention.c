/* Paged decode attention on the CPU, reading K/V in place through the block table.
 *
 * The model: a query is a sequence's last nq (1..8) tokens -- a decode is one, a speculative verify
 * step 1 + K -- and token t sees the keys up to its own position. One work item per query (or, with
 * several threads and fewer queries than two per thread, per (query, KV head)) walks the sequence's
 * blocks in order, CHUNK = 16 tokens at a time, over all its KV heads; each (KV head, token) slot's
 * G = H / KVH query heads (GQA) score the keys (q . k * scale, the 16 dot products reduced together by
 * one transpose-and-add), update a running maximum and sum (online softmax, as flash attention does)
 * and accumulate the values, rescaled whenever the maximum grows. Every K/V byte of the sequence is read
 * once per query, straight from the cache: no gathered copy, no padding to the batch's longest
 * sequence, no mask. Why per query: a block's rows of all KV heads are one contiguous
 * [block_size, KVH, D] run, so an item reads front to back; and the hardware prefetchers do not
 * follow a block table (blocks in random order, no software prefetch: 7 GB/s), so the next block's
 * K and V lines -- after an item's last block, the next item's first -- are asked into L2 one pair
 * at a time between the loads of this one, at the pace of the compute. On a 2-core Zen 4 VM (one
 * thread: a linear read ~24 GB/s, a bare read of blocks in random order with that prefetch ~18) at
 * 8 sequences x 500 tokens over 30 layers, K/V from DRAM, that is ~12 ms (~15 GB/s) against ~16-20
 * with the next block asked for in three bursts (benchmarks/paged_decode_kernel_cpu.py). A verify
 * step's tokens score each K row from L1 rather than re-reading the K/V per token.
 * Layout: kv_cache [2, num_blocks, block_size, KVH, D] float32 (K then V); query / out [T, H, D];
 * query c is rows [token_starts[c], + num_tokens[c]) of query / out, of sequence seq_rows[c] (its row
 * of block_tables [num_seqs, max_blocks] int32 and seq_lens [num_seqs] int32). D must be a multiple
 * of 16.
 */
#include "attention_common.h"

#define MAX_QUERY_TOKENS 8  /* tokens of one query (a verify step's 1 + K, a prefill's tail) */
#define MAX_SLOTS 24  /* (KV head, token) pairs one work item carries state for */

/* How many blocks ahead of the one computing the L2 prefetches run: 1 (8 x 500 tokens: 2 and 3
 * blocks ahead were 4% and 11% slower). */
#define PREFETCH_AHEAD 1

/* A cursor over the cache lines of a block's K and V rows (of the item's KV heads) still to be asked
 * into L2. Its owner asks for one line pair at a time between the loads of the block it computes, so
 * the requests flow at the pace of the compute: asked in a few bursts, they queued on the miss buffers
 * and stalled the loads (8 x 500 tokens: 20 ms against 13). Into L1 (locality 3), or non-temporal
 * (0), the same read took 19 ms. */
typedef struct {
  const float *k, *v;
  int64_t left, offset, line, per_row, row_skip;  /* row_skip: floats from a row's last line to the next row */
} Prefetcher;

INLINE Prefetcher prefetcher(const float* k, const float* v, int64_t rows, int64_t row_floats, int64_t stride) {
  return (Prefetcher){k, v, rows * (row_floats / 16), 0, 0, row_floats / 16, stride - row_floats + 16};
}

/* The next line of K and of V, if any are left. */
INLINE void prefetch_next(Prefetcher* p) {
  if (p->left <= 0) return;
  __builtin_prefetch(p->k + p->offset, 0, 2), __builtin_prefetch(p->v + p->offset, 0, 2);
  p->left--;
  if (++p->line == p->per_row) p->line = 0, p->offset += p->row_skip;
  else p->offset += 16;
}

/* Block b (if the sequence has it) of a sequence of seq_len keys, KV heads [kvh0, kvh0 + nkvh). */
INLINE Prefetcher block_prefetcher(const float* k_cache, const float* v_cache, const int32_t* blocks, int64_t b,
                                   int64_t seq_len, int64_t kvh0, int64_t nkvh, Geometry g) {
  const int64_t bs = g.block_size, rows = seq_len - b * bs < bs ? seq_len - b * bs : bs;
  if (rows <= 0) return (Prefetcher){0};
  const int64_t offset = ((int64_t)blocks[b] * bs * g.num_kv_heads + kvh0) * g.head_dim;
  return prefetcher(k_cache + offset, v_cache + offset, rows, nkvh * g.head_dim, g.num_kv_heads * g.head_dim);
}

/* acc[h] += sum_t probs[h][t] v_t over the n values at v, asking for a line of K and V of pf per value
 * row; unrolled for a full chunk (rolled, with the prefetch in it, GCC stored the accumulators to the
 * stack after every row). */
INLINE void accumulate_values(v16f acc[][MAX_VECS], const float probs[][CHUNK], const float* v, int64_t stride,
                              int64_t n, Prefetcher* pf, const int G, const int V) {
  if (n == CHUNK) {
    #pragma GCC unroll 16
    for (int t = 0; t < CHUNK; t++) {
      prefetch_next(pf);
      for (int c = 0; c < V; c++) {
        const v16f vc = load16(v + t * stride + 16 * c);
        for (int h = 0; h < G; h++) acc[h][c] += probs[h][t] * vc;
      }
    }
    return;
  }
  for (int64_t t = 0; t < n; t++) {
    prefetch_next(pf);
    for (int c = 0; c < V; c++) {
      const v16f vc = load16(v + t * stride + 16 * c);
      for (int h = 0; h < G; h++) acc[h][c] += probs[h][t] * vc;
    }
  }
}

/* Online-softmax step of one slot's G query heads over a chunk's scores: probs[h] = e^(scores - max),
 * the running maximum and sum updated and what was accumulated so far rescaled whenever the maximum
 * grows (rarer as the sequence goes on). */
INLINE void softmax_chunk(const int G, const int V, const v16f* scores, v16f acc[][V], float* running_max,
                          float* running_sum, float probs[][CHUNK]) {
  for (int h = 0; h < G; h++) {
    const float chunk_max = hmax(scores[h]), old_max = running_max[h];
    float new_max = old_max;
    if (chunk_max > old_max) {
      new_max = chunk_max;
      const float correction = exp16(splat(old_max - new_max))[0];  /* 0 on the first chunk */
      running_max[h] = new_max, running_sum[h] *= correction;
      for (int c = 0; c < V; c++) acc[h][c] *= correction;
    }
    const v16f p = exp16(scores[h] - new_max);  /* lanes >= n: e^-inf = 0 */
    running_sum[h] += hsum16(p);
    memcpy(probs[h], &p, sizeof p);
  }
}

/* One slot's G query heads over the n keys at k / v: score, online-softmax update, accumulate; with
 * per_score lines of pf asked for before each head's scores and one per value row. The accumulators
 * are copied into locals so GCC keeps them in registers for the chunk. */
INLINE void attend_chunk(const int G, const int V, const v16f qv[][V], v16f acc[][V], float* running_max,
                         float* running_sum, const float* k, const float* v, int64_t stride, int64_t n, Prefetcher* pf,
                         int64_t per_score) {
  v16f scores[G];
  float probs[G][CHUNK] __attribute__((aligned(64)));
  for (int h = 0; h < G; h++) {
    for (int64_t i = 0; i < per_score; i++) prefetch_next(pf);
    scores[h] = score_chunk(qv[h], k, stride, n, V);
  }
  softmax_chunk(G, V, scores, acc, running_max, running_sum, probs);
  v16f a[G][MAX_VECS];
  for (int h = 0; h < G; h++)
    for (int c = 0; c < V; c++) a[h][c] = acc[h][c];
  accumulate_values(a, probs, v, stride, n, pf, G, V);
  for (int h = 0; h < G; h++)
    for (int c = 0; c < V; c++) acc[h][c] = a[h][c];
}

/* KV heads [kvh0, kvh0 + nkvh) of one query's nq tokens (the sequence's last nq positions: token t
 * sees seq_len - nq + 1 + t keys), each KV head with its G query heads; q / out point at token 0's
 * first query head of KV head kvh0 (token stride `row`). Block by block, each block's rows of the
 * item's heads read once for all nq tokens. State: slot = (KV head j, token t). Block b +
 * PREFETCH_AHEAD's lines (or `then`, after the last block) are asked for one pair per value row
 * accumulated, the rest spread over the scores. */
INLINE void attend(const float* q, float* out, int64_t row, int64_t nq, const float* k_cache, const float* v_cache,
                   const int32_t* blocks, int64_t seq_len, int64_t kvh0, int64_t nkvh, Prefetcher then, Geometry g,
                   float scale, const int G, const int V) {
  const int64_t stride = g.num_kv_heads * g.head_dim, bs = g.block_size, slots = nkvh * nq;
  v16f acc[MAX_SLOTS][G][V], qv[MAX_SLOTS][G][V];
  float running_max[MAX_SLOTS][G], running_sum[MAX_SLOTS][G];
  int64_t keys[MAX_SLOTS];  /* token t's causal limit, for each slot */
  for (int64_t j = 0; j < nkvh; j++)
    for (int64_t t = 0; t < nq; t++) {
      const int64_t slot = j * nq + t;
      keys[slot] = seq_len - nq + 1 + t;
      for (int h = 0; h < G; h++) {
        running_max[slot][h] = -INFINITY, running_sum[slot][h] = 0.0f;
        for (int c = 0; c < V; c++)
          acc[slot][h][c] = (v16f){0}, qv[slot][h][c] = load16(q + t * row + (j * G + h) * g.head_dim + 16 * c) * scale;
      }
    }
  const int64_t num_blocks = (seq_len + bs - 1) / bs, chunks_per_block = (bs + CHUNK - 1) / CHUNK;
  for (int64_t b = 0; b < num_blocks; b++) {
    const int64_t offset = ((int64_t)blocks[b] * bs * g.num_kv_heads + kvh0) * g.head_dim;
    const int64_t block_len = seq_len - b * bs < bs ? seq_len - b * bs : bs;
    Prefetcher next = b + PREFETCH_AHEAD == num_blocks ? then
                      : block_prefetcher(k_cache, v_cache, blocks, b + PREFETCH_AHEAD, seq_len, kvh0, nkvh, g);
    const int64_t scores_per_block = chunks_per_block * slots * G, left = next.left - slots * block_len;
    const int64_t per_score = left > 0 ? (left + scores_per_block - 1) / scores_per_block : 0;
    /* chunks never cross a block: CHUNK tokens, or what is left of the block */
    for (int64_t in_block = 0; in_block < block_len; in_block += CHUNK) {
      const int64_t start = b * bs + in_block, chunk = block_len - in_block < CHUNK ? block_len - in_block : CHUNK;
      const float* k = k_cache + offset + in_block * stride;
      const float* v = v_cache + offset + in_block * stride;
      int64_t n[MAX_SLOTS];  /* each slot's keys in this chunk, 0 past its causal limit */
      for (int64_t slot = 0; slot < slots; slot++)
        n[slot] = keys[slot] - start < 0 ? 0 : keys[slot] - start < chunk ? keys[slot] - start : chunk;
      for (int64_t slot = 0; slot < slots; slot++)
        if (n[slot])
          attend_chunk(G, V, qv[slot], acc[slot], running_max[slot], running_sum[slot], k + slot / nq * g.head_dim,
                       v + slot / nq * g.head_dim, stride, n[slot], &next, per_score);
    }
  }
  for (int64_t slot = 0; slot < slots; slot++)
    for (int h = 0; h < G; h++)
      for (int c = 0; c < V; c++) {
        const int64_t j = slot / nq, t = slot % nq;
        const v16f o = acc[slot][h][c] / running_sum[slot][h];
        memcpy(out + t * row + (j * G + h) * g.head_dim + 16 * c, &o, sizeof o);
      }
}

/* Specialized copies for the common (GQA group, head_dim) pairs; anything else runs the generic one. */
#define CASE(GG, VV) if (G == GG && V == VV) { attend(q, o, row, nq, k, v, blocks, len, kvh, nkvh, then, geo, scale, GG, VV); return; }
static void attend_any(const float* q, float* o, int64_t row, int64_t nq, const float* k, const float* v,
                       const int32_t* blocks, int64_t len, int64_t kvh, int64_t nkvh, Prefetcher then, Geometry geo,
                       float scale) {
  const int G = (int)(geo.num_heads / geo.num_kv_heads), V = (int)(geo.head_dim / 16);
  CASE(1, 4) CASE(2, 4) CASE(3, 4) CASE(4, 4) CASE(6, 4) CASE(8, 4)
  CASE(1, 8) CASE(2, 8) CASE(3, 8) CASE(4, 8) CASE(6, 8) CASE(8, 8)
  attend(q, o, row, nq, k, v, blocks, len, kvh, nkvh, then, geo, scale, G, V);
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
   * divisor of KVH that fits; with several threads and fewer queries than two per thread, one item
   * per (query, KV head) keeps the threads busy (with one thread it would only read each block's rows
   * in KVH strided passes). */
  int64_t per_item = 1;
  if (num_threads == 1 || num_queries >= 2 * num_threads)
    for (int64_t d = num_kv_heads; d > 1; d--)
      if (num_kv_heads % d == 0 && d * longest <= MAX_SLOTS) { per_item = d; break; }
  const int64_t items_per_query = num_kv_heads / per_item;
  #pragma omp parallel for schedule(dynamic) num_threads(num_threads)
  for (int64_t item = 0; item < num_queries * items_per_query; item++) {
    const int64_t c = item / items_per_query, kvh = item % items_per_query * per_item;
    const int64_t offset = token_starts[c] * row + kvh * G * head_dim;
    /* the next item's first block, asked for during this one's last (else each sequence starts with a
     * block read at the latency-bound rate; 8 x 200 tokens: 5.1 -> 4.6 ms): with one thread this
     * thread's next item, with more maybe another thread's, one block read early for nothing */
    const int64_t after = item + 1, ca = after / items_per_query;
    const Prefetcher then = after < num_queries * items_per_query
        ? block_prefetcher(kv_cache, v_cache, block_tables + seq_rows[ca] * max_blocks, 0, seq_lens[seq_rows[ca]],
                           after % items_per_query * per_item, per_item, g)
        : (Prefetcher){0};
    attend_any(query + offset, out + offset, row, num_tokens[c], kv_cache, v_cache,
               block_tables + seq_rows[c] * max_blocks, seq_lens[seq_rows[c]], kvh, per_item, then, g, scale);
  }
  return 0;
}
