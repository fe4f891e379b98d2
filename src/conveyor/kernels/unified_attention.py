"""One paged-attention kernel for a mixed batch: prefill chunks (with cached prefixes) and decodes.

The model (see paged_batch.py for the batch layout): each program owns one *query block* of one
sequence -- BLOCK_Q consecutive query tokens -- times all `group` query heads that share one KV head
(GQA packing: BLOCK_M = BLOCK_Q * GROUP_PAD rows), so each K/V tile fetched from the cache serves
every head of the group. It walks the sequence's block table tile by tile (TILE_N keys gathered from
any number of cache blocks) up to the last key its block can see, with an online softmax in float32
(exp2, scale folded with log2 e), in two loops: the tiles wholly before the block's first query
position, which every row sees, without masks; then the one or two tiles that reach the block's
diagonal, with the causal and bounds masks. The grid is (num_tokens // BLOCK_Q + num_seqs, num_kv_heads): it
depends only on token and sequence counts, never on the values of query lengths, so the launch is
CUDA-graph capturable. Sequence i's query blocks start at program `query_start_loc[i] // BLOCK_Q + i`
(this never overlaps the next sequence's); a program finds its sequence by binary search over
`query_start_loc` and exits if it falls in the gap after the sequence's last block.

HEAVY_FIRST_NOTE: within a sequence the programs take its query blocks last to first. Under the causal
mask block b reads b + 1 tiles' worth of keys (plus the cached context), so the last block is the heaviest,
and the GPU starts blocks roughly in program order: in query order the heaviest blocks of the last KV
head started last and ran alone at the end of the launch (one 1,200-token chunk is 75 blocks x 8 KV heads,
~2 waves on 132 SMs). Longest first is the classic fix for that tail (as FlashAttention orders causal
blocks); the results are unchanged, only which program computes which block.

DECODE_ORDER_NOTE: the decode launch's programs may take their sequences through a permutation, longest
context first (`decode_order_of`: one device sort a step, shared by every layer). A decode program's time
is its context's K/V read, and the GPU starts programs roughly in order: a batch drawn in any order ends
with whatever long sequences came last running alone. On an H100 a batch of 256 decodes of 100-2,048 keys
ran 1.4% (Qwen3-0.6B heads) and 2.1% (Llama-3.1-8B) faster sorted longest first (`kernels.py --order`). An FP8 cache
(KV_FP8) is converted tile by tile right after its load to the query's dtype (exact: e4m3 and e5m2 fit
in bf16 and fp16), so the dot products stay bf16/fp16 ones, and the per-tensor scales are folded out of
the loop: k_scale into the softmax scale (q.(k s_k) = s_k q.k), v_scale into the output (sum p v s_v =
s_v sum p v). At the default unit scales that is the same arithmetic as dequantizing each element first.

FP8_DOT_NOTE: over an FP8 cache a bf16 query is cast to fp16 once, and K/V tiles convert to fp16, so both
dots (q.k and p.v) run in fp16. On sm_89+ e4m3/e5m2 -> fp16 is one `cvt` per two elements, while -> bf16
adds a scalar fp16 -> bf16 `cvt` per element: compiled for sm_90 (Triton 3.6), the decode program's
PTX falls from 3,969 to 2,977 instructions (the bf16-cache kernel has 1,458 for half the keys). The cast
is exact for a bf16 query in fp16's range (|q| < 65,504; below 2^-14 it keeps fewer bits, and those
terms are below the dot's float32 accumulation error anyway); p in [0, 1] keeps more bits in fp16.
"""

from dataclasses import dataclass

import torch

from conveyor.kernels.fp8_kv import UNIT_KV_SCALES, KVScales, is_fp8
from conveyor.kernels.paged_batch import PagedBatch, check_paged_inputs, paged_attention_ref
from conveyor.kernels.triton_compat import tl, triton

LOG2_E = 1.4426950408889634


def score_scale(scale: float, kv_scales: KVScales, cache_dtype: torch.dtype) -> float:
    """The kernels' softmax scale in log2 units; an FP8 cache folds k_scale in (q.(k s_k) = s_k q.k), so
    no key element is multiplied in the loop."""
    return scale * LOG2_E * (kv_scales.k_scale if is_fp8(cache_dtype) else 1.0)
ALL_ROWS = 0
"""`ROWS` of a launch: every sequence of the batch (decode-only batches: they all have one token)."""
DECODE_ROWS = 1
"""Only the one-token sequences, one program each (grid (num_seqs, num_kv_heads))."""
PREFILL_ROWS = 2
"""Only the sequences of more than one token (the grid of ALL_ROWS; one-token programs exit at once)."""


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, q_block_id, BLOCK_Q: tl.constexpr):
    """Last sequence whose first query-block program is <= q_block_id (binary search)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block_id:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _program_block(query_start_loc_ptr, order_ptr, num_seqs, BLOCK_Q: tl.constexpr, ROWS: tl.constexpr,
                   HAS_ORDER: tl.constexpr):
    """(sequence, query block within it, its first token, its query length, whether this program has
    work) for program_id(0). DECODE_ROWS (1): program i is sequence i (order[i] with HAS_ORDER: see
    DECODE_ORDER_NOTE), active only with one token;
    otherwise programs are query blocks (see the module docstring), and PREFILL_ROWS (2) also leaves
    one-token sequences to the decode launch."""
    if ROWS == 1:
        seq = tl.program_id(0)
        if HAS_ORDER:
            seq = tl.load(order_ptr + seq).to(tl.int32)
        q_block = seq * 0  # a tensor like the other branch's
    else:
        q_block_id = tl.program_id(0)
        seq = _find_sequence(query_start_loc_ptr, num_seqs, q_block_id, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if ROWS == 1:
        active = q_len == 1
    else:
        # Heaviest first (HEAVY_FIRST_NOTE): the sequence's first program takes its last query block.
        local = q_block_id - (q_start // BLOCK_Q + seq)
        num_blocks = tl.cdiv(q_len, BLOCK_Q)
        active = local < num_blocks
        q_block = num_blocks - 1 - local
        if ROWS == 2:
            active = active & (q_len != 1)
    return seq, q_block, q_start, q_len, active


@triton.jit
def online_softmax_step(acc, m_i, l_i, scores, v):
    """One tile of the online softmax: scores [M, N] (log2 units, -inf where masked) and V [N, D] fold into
    the running max m_i [M], sum l_i [M] and unnormalized output acc [M, D] (float32)."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def _attend_tiles(acc, m_i, l_i, q, query_pos, start, end, kv_end, table_row, k_base, v_base, scale_log2,
                  stride_k_b, stride_k_s, stride_v_b, stride_v_s, dims, dim_valid,
                  TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAD_DIMS: tl.constexpr,
                  MASKED: tl.constexpr, KV_FP8: tl.constexpr):
    """Online softmax over the keys [start, end) in TILE_N tiles gathered through the block table;
    MASKED applies the causal and bounds masks (only the tiles that reach the block's diagonal)."""
    cols = tl.arange(0, TILE_N)
    for tile_start in range(start, end, TILE_N):
        key_pos = tile_start + cols  # [TILE_N]
        if MASKED:
            key_valid = key_pos < kv_end
            block_ids = tl.load(table_row + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        else:
            block_ids = tl.load(table_row + key_pos // BLOCK_SIZE).to(tl.int64)
        in_block = key_pos % BLOCK_SIZE
        k_offsets = block_ids[:, None] * stride_k_b + in_block[:, None] * stride_k_s + dims[None, :]
        v_offsets = block_ids[:, None] * stride_v_b + in_block[:, None] * stride_v_s + dims[None, :]
        if MASKED:
            kv_mask = key_valid[:, None] & dim_valid[None, :]
            k = tl.load(k_base + k_offsets, mask=kv_mask, other=0.0)  # [N, D]
            v = tl.load(v_base + v_offsets, mask=kv_mask, other=0.0)
        elif PAD_DIMS:  # head_dim below its power of two: never read the next head's values
            k = tl.load(k_base + k_offsets, mask=dim_valid[None, :], other=0.0)
            v = tl.load(v_base + v_offsets, mask=dim_valid[None, :], other=0.0)
        else:
            k = tl.load(k_base + k_offsets)
            v = tl.load(v_base + v_offsets)
        if KV_FP8:  # [N, D] fp8 -> the query's dtype, exactly (tl.dot takes no fp8 x bf16 mix); the
            k = k.to(q.dtype)  # scales are folded: k_scale into scale_log2 (host), v_scale into the output
            v = v.to(q.dtype)
        scores = tl.dot(q, tl.trans(k)) * scale_log2  # [BLOCK_M, TILE_N], log2 units
        if MASKED:
            visible = (key_pos[None, :] <= query_pos[:, None]) & key_valid[None, :]
            scores = tl.where(visible, scores, float("-inf"))
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, scores, v)
    return acc, m_i, l_i


# Triton specializes integer arguments on "== 1" and "divisible by 16". `num_seqs` and the block-table
# row stride (the widest request's block count in an eager step) change every step, so specializing
# on them would compile new variants mid-serving; they are kept generic so start-up warm-up covers all.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt_s"])
def _unified_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, order_ptr,
    scale_log2, num_seqs, v_scale,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_k_b, stride_k_s, stride_k_h, stride_v_b, stride_v_s, stride_v_h, stride_bt_s,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    ROWS: tl.constexpr, KV_FP8: tl.constexpr, HAS_ORDER: tl.constexpr,
):
    kv_head = tl.program_id(1)
    seq, q_block, q_start, q_len, active = _program_block(query_start_loc_ptr, order_ptr, num_seqs, BLOCK_Q, ROWS,
                                                          HAS_ORDER)
    if active == 0:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    token = q_block * BLOCK_Q + rows // GROUP_PAD  # [BLOCK_M] query index within the sequence
    head = kv_head * GROUP + rows % GROUP_PAD
    row_valid = (token < q_len) & (rows % GROUP_PAD < GROUP)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    q_offsets = (q_start + token)[:, None] * stride_q_t + head[:, None] * stride_q_h + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    if KV_FP8 and q.dtype == tl.bfloat16:  # fp16 dots: see FP8_DOT_NOTE
        q = q.to(tl.float16)
    query_pos = context_len + token  # [BLOCK_M]

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: a fully masked tile gives p = 0, not NaN
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    kv_end = tl.minimum(context_len + (q_block + 1) * BLOCK_Q, seq_len)  # keys this block may see
    # Keys before the block's first query position are visible to every row: those whole tiles need no
    # causal or bounds mask (most tiles of a long prefill, all but the last of a decode).
    # A CUDA graph's padding sequence has seq_len 0 and owns many query tokens (context_len < 0): the
    # clamp keeps its programs out of both loops, so they never read its (stale) block-table row.
    full_end = tl.maximum(tl.minimum((context_len + q_block * BLOCK_Q) // TILE_N * TILE_N, kv_end), 0)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_s
    k_base = k_cache_ptr + kv_head * stride_k_h
    v_base = v_cache_ptr + kv_head * stride_v_h
    acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, query_pos, 0, full_end, kv_end, table_row, k_base, v_base,
                                  scale_log2, stride_k_b, stride_k_s, stride_v_b, stride_v_s, dims,
                                  dim_valid, TILE_N, BLOCK_SIZE, HEAD_DIM != HEAD_DIM_PAD,
                                  False, KV_FP8)
    acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, query_pos, full_end, kv_end, kv_end, table_row, k_base,
                                  v_base, scale_log2, stride_k_b, stride_k_s, stride_v_b, stride_v_s, dims,
                                  dim_valid, TILE_N, BLOCK_SIZE, HEAD_DIM != HEAD_DIM_PAD,
                                  True, KV_FP8)
    acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # padding sequences (seq_len 0) write zeros
    if KV_FP8:  # sum p (v s_v) = s_v sum p v
        acc = acc * v_scale
    o_offsets = (q_start + token)[:, None] * stride_o_t + head[:, None] * stride_o_h + dims[None, :]
    tl.store(out_ptr + o_offsets, acc.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None] & dim_valid[None, :])


@dataclass(frozen=True)
class UnifiedTile:
    """Launch shape of the unified kernel."""

    block_q: int
    """Query tokens per program."""
    block_m: int
    """Rows per program: block_q * group_pad (query tokens x the KV head's query heads)."""
    tile_n: int
    """Keys per inner-loop tile."""
    num_warps: int
    num_stages: int


# A decode program is bound by the K/V bytes it keeps in flight: 64 keys of a 16-bit cache per tile.
# An FP8 cache holds a key in half the bytes, so its decode tile takes twice the keys for the same bytes
# (with 64, an H100 read FP8 K/V at 1.6 TB/s against bf16's 2.7: docs/performance.md, FP8 on an H100).
DECODE_TILE_BYTES = 64 * 2


def decode_tile_n(kv_element_size: int) -> int:
    """Keys per tile of a decode program: the same bytes in flight at any cache dtype."""
    return DECODE_TILE_BYTES // kv_element_size


def decode_stages(kv_element_size: int) -> int:
    """Pipeline stages of a decode tile: 3 over an FP8 cache (the H100 sweep of 2026-12-07, 128 keys, 4 warps:
    Llama batch 256 0.274 -> 0.266 ms, Qwen3 0.279 -> 0.271 ms against 2), 2 over 16 bits as tuned before."""
    return 3 if kv_element_size == 1 else 2


def unified_tile(max_query_len: int, group: int, kv_element_size: int = 2) -> UnifiedTile:
    """Small row blocks for decode-only batches (memory-bound), 64 rows when prefills are in."""
    group_pad = triton.next_power_of_2(group)
    block_m = max(16 if max_query_len == 1 else 64, group_pad)
    tile_n = decode_tile_n(kv_element_size) if max_query_len == 1 else 64
    stages = decode_stages(kv_element_size) if max_query_len == 1 else 2
    return UnifiedTile(block_q=block_m // group_pad, block_m=block_m, tile_n=tile_n, num_warps=4, num_stages=stages)


def decode_tile(group: int, kv_element_size: int = 2) -> UnifiedTile:
    """One token per program (DECODE_ROWS): the group's query heads, padded to tl.dot's 16 rows."""
    return UnifiedTile(block_q=1, block_m=max(16, triton.next_power_of_2(group)),
                       tile_n=decode_tile_n(kv_element_size), num_warps=4,
                       num_stages=decode_stages(kv_element_size))


def unified_attention(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, batch: PagedBatch,
    scale: float, *, kv_scales: KVScales = UNIT_KV_SCALES, decode_order: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [T, H, d] (bf16/fp16) + paged caches [nb, bs, kvh, d] (the query's dtype, or FP8 read back
    with `kv_scales`) -> [T, H, d], causal; no host sync.

    A mixed batch is two launches into one output: its one-token sequences with the decode tile, the
    others with 64-row blocks. In one launch of 64-row blocks a decode row (one token x the group's
    heads: 4 of 64 rows for Llama's GQA 4) paid 16x the matrix multiplies and exponentials of the
    decode tile for the same K/V reads, and decodes are most of a mixed step's attention online.
    Which sequence each launch takes is decided in the kernel from the query lengths, so the launches
    stay CUDA-graph capturable. `decode_order` [num_seqs] (int32/int64, a permutation of the sequences,
    longest first: `decode_order_of`) orders the decode launch's programs (DECODE_ORDER_NOTE); a
    decode-only batch given one takes the decode launch alone, in that order."""
    group, kv_size = query.shape[1] // key_cache.shape[2], key_cache.element_size()
    caches = (key_cache, value_cache)
    if batch.max_query_len == 1 and decode_order is None:
        decode_only = unified_tile(1, group, kv_size)
        return unified_attention_with_tile(query, caches, batch, scale, decode_only, kv_scales=kv_scales)
    out = torch.empty_like(query)
    _launch(out, query, caches, batch, scale, decode_tile(group, kv_size), DECODE_ROWS, kv_scales, decode_order)
    if batch.max_query_len > 1:
        _launch(out, query, caches, batch, scale, unified_tile(batch.max_query_len, group), PREFILL_ROWS, kv_scales)
    return out


def decode_order_of(seq_lens: torch.Tensor) -> torch.Tensor:
    """[num_seqs] int64: the sequences longest first (DECODE_ORDER_NOTE); one sort, on the device."""
    return torch.argsort(seq_lens, descending=True)


def unified_attention_with_tile(
    query: torch.Tensor, caches: tuple[torch.Tensor, torch.Tensor], batch: PagedBatch, scale: float,
    tile: UnifiedTile, *, kv_scales: KVScales = UNIT_KV_SCALES,
) -> torch.Tensor:
    """`unified_attention` in one launch with an explicit launch shape (benchmarks sweep it)."""
    out = torch.empty_like(query)
    _launch(out, query, caches, batch, scale, tile, ALL_ROWS, kv_scales)
    return out


def _launch(
    out: torch.Tensor, query: torch.Tensor, caches: tuple[torch.Tensor, torch.Tensor], batch: PagedBatch,
    scale: float, tile: UnifiedTile, rows: int, kv_scales: KVScales, order: torch.Tensor | None = None,
) -> None:
    """One launch over the sequences `rows` selects, writing their tokens of `out` [T, H, d]; `order`
    [num_seqs] permutes the decode launch's programs (None: program i takes sequence i)."""
    key_cache, value_cache = caches
    check_paged_inputs(query, key_cache, value_cache, batch)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    if num_tokens == 0:
        return
    if rows == DECODE_ROWS:
        assert tile.block_q == 1 and tile.block_m >= group_pad, f"a decode tile holds one token: {tile}"
        assert order is None or order.shape == (batch.num_seqs,), "one order entry a sequence"
        grid = (batch.num_seqs, num_kv_heads)
    else:
        assert order is None, "only the decode launch takes an order"
        assert tile.block_q * group_pad == tile.block_m, f"block_m must be block_q * {group_pad}: {tile}"
        grid = (num_tokens // tile.block_q + batch.num_seqs, num_kv_heads)
    _unified_attention_kernel[grid](
        out, query, key_cache, value_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
        batch.seq_lens if order is None else order,  # order_ptr: unread without HAS_ORDER
        score_scale(scale, kv_scales, key_cache.dtype), batch.num_seqs, kv_scales.v_scale,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), batch.block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=tile.block_q, BLOCK_M=tile.block_m,
        TILE_N=tile.tile_n, HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=key_cache.shape[1], ROWS=rows, KV_FP8=is_fp8(key_cache.dtype), HAS_ORDER=order is not None, num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )


def unified_attention_ref(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, batch: PagedBatch,
    scale: float, *, kv_scales: KVScales = UNIT_KV_SCALES,
) -> torch.Tensor:
    """float32 reference of `unified_attention` (any mix of query lengths)."""
    return paged_attention_ref(query, key_cache, value_cache, batch, scale, kv_scales=kv_scales)

