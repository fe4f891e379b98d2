/* Paged decode attention on the CPU, reading K/V in place through the block table.
 *
 * The model: one work item per decode sequence (or per (sequence, KV head) when there are fewer
 * sequences than two per thread). An item walks the sequence's blocks in order and, within a block,
 * its KV heads one after the other, 16 tokens at a time; each KV head's G = H / KVH query heads (GQA)
 * score the keys (q . k * scale, the 16 dot products reduced together by one transpose-and-add),
 * update a running maximum and sum (online softmax, as flash attention does) and accumulate the
 * values, rescaled whenever the maximum grows. Every K/V byte of the sequence is read exactly once,
 * straight from the cache: no gathered copy, no padding to the batch's longest sequence, no mask.
 * Why per sequence: a block's rows of all KV heads are one contiguous [block_size, KVH, D] run, so an
 * item reads front to back, and the next block's rows are prefetched into L2 while this one computes.
 * On a 2-core Zen 5 VM at 8 sequences x 400 tokens (30 layers, K/V from DRAM) that took a step's
 * attention from 26 to 14 ms; a plain read of the same blocks in (sequence, KV head) order runs at
 * 7 GB/s, in sequence order 11, with the L2 prefetch 16 (a linear stream: 22).
 * Layout: kv_cache [2, num_blocks, block_size, KVH, D] float32 (K then V); query / out [T, H, D];
 * token_rows [S] (the decode tokens' rows in query / out), seq_rows [S] (their rows in block_tables
 * [num_seqs, max_blocks] int32 and seq_lens [num_seqs] int32). D must be a multiple of 16.
 */
#include "attention_common.h"

#define MAX_HEADS_PER_ITEM 8  /* KV heads one work item walks together */

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

/* KV heads [kvh0, kvh0 + nkvh) of one sequence, each with its G query heads (q, out: [nkvh * G, D]).
 * Block by block, and within a block KV head by KV head, so one item reads each block's rows of
 * its heads front to back -- with every KV head in one item, a contiguous [block_size, KVH, D] run. */
INLINE void attend(const float* q, const float* k_cache, const float* v_cache, const int32_t* blocks,
                   int64_t seq_len, int64_t kvh0, int64_t nkvh, Geometry g, float scale, float* out,
                   const int G, const int V) {
  const int64_t stride = g.num_kv_heads * g.head_dim, bs = g.block_size;
  v16f acc[MAX_HEADS_PER_ITEM][G][V], qv[MAX_HEADS_PER_ITEM][G][V];
  float running_max[MAX_HEADS_PER_ITEM][G], running_sum[MAX_HEADS_PER_ITEM][G];
  float probs[G][CHUNK] __attribute__((aligned(64)));
  for (int64_t j = 0; j < nkvh; j++)
    for (int h = 0; h < G; h++) {
      running_max[j][h] = -INFINITY, running_sum[j][h] = 0.0f;
      for (int c = 0; c < V; c++) acc[j][h][c] = (v16f){0}, qv[j][h][c] = load16(q + (j * G + h) * g.head_dim + 16 * c) * scale;
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
      const int64_t n = block_len - in_block < CHUNK ? block_len - in_block : CHUNK;
      for (int64_t j = 0; j < nkvh; j++) {
        if (next_k)
          prefetch_block(next_k, v_cache + (next_k - k_cache), nkvh * g.head_dim, next_len, stride,
                         in_block / CHUNK * nkvh + j, (block_len + CHUNK - 1) / CHUNK * nkvh);
        const float* k = kb + in_block * stride + j * g.head_dim;
        const float* v = vb + in_block * stride + j * g.head_dim;
        v16f a[G][MAX_VECS];
        for (int h = 0; h < G; h++)
          for (int c = 0; c < V; c++) a[h][c] = acc[j][h][c];
        for (int h = 0; h < G; h++) {
          const v16f scores = score_chunk(qv[j][h], k, stride, n, V);
          const float chunk_max = hmax(scores), old_max = running_max[j][h];
          float new_max = old_max;
          if (chunk_max > old_max) {  /* rescale what was summed so far; rarer as the sequence goes on */
            new_max = chunk_max;
            const float correction = exp16(splat(old_max - new_max))[0];  /* 0 on the first chunk */
            running_max[j][h] = new_max, running_sum[j][h] *= correction;
            for (int c = 0; c < V; c++) a[h][c] *= correction;
          }
          const v16f p = exp16(scores - new_max);  /* lanes >= n: e^-inf = 0 */
          running_sum[j][h] += hsum16(p);
          memcpy(probs[h], &p, sizeof p);
        }
        accumulate_values(a, probs, v, stride, n, G, V);
        for (int h = 0; h < G; h++)
          for (int c = 0; c < V; c++) acc[j][h][c] = a[h][c];
      }
    }
  }
  for (int64_t j = 0; j < nkvh; j++)
    for (int h = 0; h < G; h++)
      for (int c = 0; c < V; c++) {
        const v16f o = acc[j][h][c] / running_sum[j][h];
        memcpy(out + (j * G + h) * g.head_dim + 16 * c, &o, sizeof o);
      }
}

/* Specialized copies for the common (GQA group, head_dim) pairs; anything else runs the generic one. */
#define CASE(GG, VV) if (G == GG && V == VV) { attend(q, k, v, blocks, len, kvh, nkvh, geo, scale, o, GG, VV); return; }
static void attend_any(const float* q, const float* k, const float* v, const int32_t* blocks, int64_t len,
                       int64_t kvh, int64_t nkvh, Geometry geo, float scale, float* o) {
  const int G = (int)(geo.num_heads / geo.num_kv_heads), V = (int)(geo.head_dim / 16);
  CASE(1, 4) CASE(2, 4) CASE(3, 4) CASE(4, 4) CASE(6, 4) CASE(8, 4)
  CASE(1, 8) CASE(2, 8) CASE(3, 8) CASE(4, 8) CASE(6, 8) CASE(8, 8)
  attend(q, k, v, blocks, len, kvh, nkvh, geo, scale, o, G, V);
}

int paged_decode_attention(const float* query, const float* kv_cache, const int64_t* token_rows,
                           const int64_t* seq_rows, const int32_t* block_tables, int64_t max_blocks,
                           const int32_t* seq_lens, int64_t num_decodes, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t block_size, int64_t num_blocks, float scale, float* out,
                           int num_threads) {
  if (head_dim % 16 || head_dim > 16 * MAX_VECS || num_heads % num_kv_heads || num_heads / num_kv_heads > MAX_GROUP)
    return 1;
  const Geometry g = {num_heads, num_kv_heads, head_dim, block_size, num_blocks};
  const float* v_cache = kv_cache + num_blocks * block_size * num_kv_heads * head_dim;
  const int64_t G = num_heads / num_kv_heads;
  /* One item per sequence walks all its KV heads (contiguous rows); with fewer sequences than two per
   * thread, one item per (sequence, KV head) keeps the threads busy. */
  const int64_t per_item = num_decodes >= 2 * num_threads && num_kv_heads <= MAX_HEADS_PER_ITEM ? num_kv_heads : 1;
  const int64_t items_per_seq = num_kv_heads / per_item;
  #pragma omp parallel for schedule(dynamic) num_threads(num_threads)
  for (int64_t item = 0; item < num_decodes * items_per_seq; item++) {
    const int64_t i = item / items_per_seq, kvh = item % items_per_seq * per_item;
    const int64_t row = token_rows[i] * num_heads * head_dim + kvh * G * head_dim;
    attend_any(query + row, kv_cache, v_cache, block_tables + seq_rows[i] * max_blocks, seq_lens[seq_rows[i]], kvh,
               per_item, g, scale, out + row);
  }
  return 0;
}
