/* A Llama-family decoder stack over few tokens (decode and verify steps) in one C call.
 *
 * The model: a decode step of a small model on the CPU is ~12 kernel calls per layer (norm, the four
 * block matmuls, rope twice, the K/V store, attention, SiLU-and-mul, two residual adds), each of which
 * costs microseconds of Python, torch dispatch and ctypes around it; with SmolLM2's 30 layers that was
 * ~6 ms of a 21 ms batch-1 step. Here the same kernels run in the same order on the same buffers, so
 * the result is bit-identical to the per-layer path (model/llama.py with the cpu attention backend and
 * GGUF block weights), and Python is entered once per step instead of ~400 times. Per layer, x [T, H]
 * (the residual stream, updated in place):
 *   h = rms_norm(x);  qkv = h Wqkv^T;  rope(q), rope(k);  K/V rows -> their cache slots;
 *   attn = paged attention of q (queries of <= 8 tokens: the decode kernel, longer: the prefill kernel);
 *   x += attn Wo^T;  h = rms_norm(x);  x += silu_and_mul(h Wgate_up^T) Wdown^T.
 * Scratch buffers are the caller's (sized for the largest T it sends).
 */
#include <stdint.h>
#include <string.h>

/* The kernels of the other files of this library that a layer calls. */
int q4_matmul(const float* x, int64_t M, int64_t K, const uint8_t* qs, const float* d, const float* m,
              int64_t N, float* out, int num_threads);
int q8_0_matmul(const float* x, int64_t M, int64_t K, const int8_t* qs, const float* d, int64_t N, float* out,
                int num_threads);
int paged_decode_attention(const float* query, const float* kv_cache, const int64_t* token_starts,
                           const int64_t* num_tokens, const int64_t* seq_rows, const int32_t* block_tables,
                           int64_t max_blocks, const int32_t* seq_lens, int64_t num_queries, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t num_blocks,
                           float scale, float* out, int num_threads);
int paged_prefill_attention(const float* query, const float* kv_cache, const int64_t* token_starts,
                            const int64_t* num_tokens, const int64_t* seq_rows, const int32_t* block_tables,
                            int64_t max_blocks, const int32_t* seq_lens, int64_t num_chunks, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t num_blocks,
                            float scale, float* out, int num_threads);
void rms_norm(const float* x, int64_t rows, int64_t cols, int64_t row_stride, const float* w, float eps,
              float* out, int num_threads);
void rotary_(float* x, int64_t tokens, int64_t heads, int64_t d, int64_t token_stride, const float* cos,
             const float* sin, int num_threads);
void silu_and_mul(const float* gate_up, int64_t rows, int64_t inner, float* out, int num_threads);

typedef struct {  /* a projection [n, k] in GGUF blocks (kernels/gguf_matmul.c's layout) */
  const void* qs;
  const float* d;
  const float* m;  /* Q4 minimums; NULL: Q8_0 */
  int64_t n, k;
} BlockWeight;

typedef struct {
  const float* input_norm;  /* [H] */
  const float* post_norm;   /* [H] */
  BlockWeight qkv, o, gate_up, down;
  float* kv_cache;  /* [2, num_blocks, block_size, num_kv_heads, head_dim] */
} DecoderLayer;

typedef struct {
  int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size, num_blocks;
  float eps, scale;
} StackShape;

typedef struct {  /* one kind of attention query: [count] int64 each (attention_cpu's plan) */
  const int64_t *token_starts, *num_tokens, *seq_rows;
  int64_t count;
} Queries;

typedef struct {
  int64_t num_tokens;
  float* x;                 /* [T, H], in place */
  const float *cos, *sin;   /* [T, head_dim] */
  const int64_t* slots;     /* [T] flat cache slots */
  Queries short_queries, prefill_queries;
  const int32_t* block_tables;  /* [num_seqs, max_blocks] */
  int64_t max_blocks;
  const int32_t* seq_lens;  /* [num_seqs] */
  float *h, *qkv, *q, *attn, *gate_up, *act;  /* scratch: [T, H], [T, Q + 2 KV], [T, Q] x 2, [T, 2 I], [T, I] */
} StepInputs;

/* out [M, n] = x [M, k] W^T; nonzero where the kernel could not allocate its packed input. */
static int project(const float* x, int64_t M, const BlockWeight* w, float* out, int num_threads) {
  if (w->m) return q4_matmul(x, M, w->k, (const uint8_t*)w->qs, w->d, w->m, w->n, out, num_threads);
  return q8_0_matmul(x, M, w->k, (const int8_t*)w->qs, w->d, w->n, out, num_threads);
}

static void add_rows(float* x, const float* y, int64_t count) {
  for (int64_t i = 0; i < count; i++) x[i] += y[i];
}

/* K and V rows of qkv [T, Q + 2 KV] into the cache slots (the attention reads them right after). */
static void store_kv(const StepInputs* s, const StackShape* g, float* kv_cache) {
  const int64_t q_size = g->num_heads * g->head_dim, kv_size = g->num_kv_heads * g->head_dim;
  const int64_t row = q_size + 2 * kv_size, plane = g->num_blocks * g->block_size * kv_size;
  for (int64_t t = 0; t < s->num_tokens; t++) {
    const float* src = s->qkv + t * row + q_size;
    memcpy(kv_cache + s->slots[t] * kv_size, src, kv_size * sizeof(float));
    memcpy(kv_cache + plane + s->slots[t] * kv_size, src + kv_size, kv_size * sizeof(float));
  }
}

static int attend(const StepInputs* s, const StackShape* g, const float* kv_cache, int num_threads) {
  const Queries* kinds[2] = {&s->short_queries, &s->prefill_queries};
  for (int i = 0; i < 2; i++) {
    const Queries* qs = kinds[i];
    if (!qs->count) continue;
    const int status = (i == 0 ? paged_decode_attention : paged_prefill_attention)(
        s->q, kv_cache, qs->token_starts, qs->num_tokens, qs->seq_rows, s->block_tables, s->max_blocks,
        s->seq_lens, qs->count, g->num_heads, g->num_kv_heads, g->head_dim, g->block_size, g->num_blocks,
        g->scale, s->attn, num_threads);
    if (status) return status;
  }
  return 0;
}

static int attention_block(const DecoderLayer* l, const StackShape* g, const StepInputs* s, int num_threads) {
  const int64_t T = s->num_tokens, H = g->hidden, q_size = g->num_heads * g->head_dim;
  const int64_t row = q_size + 2 * g->num_kv_heads * g->head_dim;
  rms_norm(s->x, T, H, H, l->input_norm, g->eps, s->h, num_threads);
  if (project(s->h, T, &l->qkv, s->qkv, num_threads)) return 2;
  rotary_(s->qkv, T, g->num_heads, g->head_dim, row, s->cos, s->sin, num_threads);
  rotary_(s->qkv + q_size, T, g->num_kv_heads, g->head_dim, row, s->cos, s->sin, num_threads);
  store_kv(s, g, l->kv_cache);
  for (int64_t t = 0; t < T; t++) memcpy(s->q + t * q_size, s->qkv + t * row, q_size * sizeof(float));
  const int status = attend(s, g, l->kv_cache, num_threads);
  if (status) return status;
  if (project(s->attn, T, &l->o, s->h, num_threads)) return 2;
  add_rows(s->x, s->h, T * H);
  return 0;
}

static int mlp_block(const DecoderLayer* l, const StackShape* g, const StepInputs* s, int num_threads) {
  const int64_t T = s->num_tokens, H = g->hidden;
  rms_norm(s->x, T, H, H, l->post_norm, g->eps, s->h, num_threads);
  if (project(s->h, T, &l->gate_up, s->gate_up, num_threads)) return 2;
  silu_and_mul(s->gate_up, T, g->intermediate, s->act, num_threads);
  if (project(s->act, T, &l->down, s->h, num_threads)) return 2;
  add_rows(s->x, s->h, T * H);
  return 0;
}

/* Returns 0; 1 for a geometry the attention kernels do not take; 2 where a kernel could not allocate. */
int decoder_stack(const DecoderLayer* layers, int64_t num_layers, const StackShape* shape, const StepInputs* step,
                  int num_threads) {
  for (int64_t i = 0; i < num_layers; i++) {
    int status = attention_block(&layers[i], shape, step, num_threads);
    if (!status) status = mlp_block(&layers[i], shape, step, num_threads);
    if (status) return status;
  }
  return 0;
}
