"""Split-KV paged attention for decode batches: many programs per sequence, then a reduction.

The model: with few decoding sequences (or very long contexts) the unified kernel runs only
num_seqs * num_kv_heads programs, too few to fill 132 SMs, and each walks its whole context alone.
Here the context of every (sequence, KV head) is cut into `num_splits` equal spans (whole tiles);
program (seq, kv_head, split) computes attention of the group's query heads over its span only and
writes the normalised partial output and its log-sum-exp (base 2). The reduction kernel then merges
the splits of each (seq, head): out = sum_s 2^(lse_s - max) * o_s / sum_s 2^(lse_s - max). Empty spans
(short sequences, padding sequences of seq_len 0) write lse = -inf and weigh nothing. Decode only:
exactly one query token per sequence, token i belonging to sequence i. An FP8 cache is dequantized
after each tile's load (x * scale in float32, then the query's dtype), as in unified_attention.py.
"""

import math
from dataclasses import dataclass

import torch

from conveyor.kernels.fp8_kv import UNIT_KV_SCALES, KVScales, dequantize_kv, is_fp8
from conveyor.kernels.paged_batch import PagedBatch, check_paged_inputs, paged_attention_ref
from conveyor.kernels.triton_compat import tl, triton
from conveyor.kernels.unified_attention import online_softmax_step, score_scale

TILE_N = 64
"""Keys per inner-loop tile; every split spans a whole number of tiles."""


@dataclass(frozen=True)
class SplitKVParams:
    """How to run split-KV attention."""

    scale: float
    """Softmax scale (usually head_dim ** -0.5)."""
    num_splits: int
    """Spans each context is cut into (see `choose_num_splits`)."""
    kv_scales: KVScales = UNIT_KV_SCALES
    """Per-tensor K/V scales an FP8 cache is read back with (ignored for 16-bit caches)."""


# num_splits and the block-table stride vary from step to step in eager decodes: no specialization on
# them (see unified_attention.py), so one compiled variant serves every step.
@triton.jit(do_not_specialize=["num_splits", "stride_bt_s"])
def _split_kv_decode_kernel(
    partial_out_ptr, partial_lse_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    scale_log2, num_splits, v_scale,
    stride_q_t, stride_q_h, stride_k_b, stride_k_s, stride_k_h, stride_v_b, stride_v_s, stride_v_h,
    stride_bt_s,
    GROUP: tl.constexpr, ROWS: tl.constexpr, TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, KV_FP8: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    span = tl.cdiv(tl.cdiv(seq_len, num_splits), TILE_N) * TILE_N
    span_start = split * span
    span_end = tl.minimum(span_start + span, seq_len)

    rows = tl.arange(0, ROWS)  # query heads of the group, padded to >= 16 rows for tl.dot
    head = kv_head * GROUP + rows
    row_valid = rows < GROUP
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    q_offsets = seq * stride_q_t + head[:, None] * stride_q_h + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    if KV_FP8 and q.dtype == tl.bfloat16:  # fp16 dots over an FP8 cache (unified_attention.py, FP8_DOT_NOTE)
        q = q.to(tl.float16)

    m_i = tl.full([ROWS], -1.0e30, tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM_PAD], tl.float32)
    cols = tl.arange(0, TILE_N)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_s
    for tile_start in range(span_start, span_end, TILE_N):
        key_pos = tile_start + cols
        key_valid = key_pos < span_end
        block_ids = tl.load(table_row + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        in_block = key_pos % BLOCK_SIZE
        kv_mask = key_valid[:, None] & dim_valid[None, :]
        k_offsets = block_ids[:, None] * stride_k_b + in_block[:, None] * stride_k_s + dims[None, :]
        k = tl.load(k_cache_ptr + kv_head * stride_k_h + k_offsets, mask=kv_mask, other=0.0)
        v_offsets = block_ids[:, None] * stride_v_b + in_block[:, None] * stride_v_s + dims[None, :]
        v = tl.load(v_cache_ptr + kv_head * stride_v_h + v_offsets, mask=kv_mask, other=0.0)
        if KV_FP8:  # [TILE_N, D] fp8 -> the query's dtype, exactly; k_scale is folded into scale_log2 (score_scale), v_scale below
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        scores = tl.dot(q, tl.trans(k)) * scale_log2  # [ROWS, TILE_N]
        scores = tl.where(key_valid[None, :], scores, float("-inf"))
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, scores, v)
    lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
    acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if KV_FP8:  # sum p (v s_v) = s_v sum p v; the reduce's weights are linear in it
        acc = acc * v_scale
    # partial_out [S, H, num_splits, HEAD_DIM_PAD] float32, partial_lse [S, H, num_splits]
    num_heads = tl.num_programs(1) * GROUP
    row_base = (seq * num_heads + head) * num_splits + split  # [ROWS]
    tl.store(partial_lse_ptr + row_base, lse, mask=row_valid)
    tl.store(partial_out_ptr + row_base[:, None] * HEAD_DIM_PAD + dims[None, :], acc,
             mask=row_valid[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def _split_kv_reduce_kernel(
    out_ptr, partial_out_ptr, partial_lse_ptr, num_splits, stride_o_t, stride_o_h,
    SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row_base = (seq * tl.num_programs(1) + head) * num_splits
    splits = tl.arange(0, SPLITS_PAD)
    split_valid = splits < num_splits
    lse = tl.load(partial_lse_ptr + row_base + splits, mask=split_valid, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    weight = tl.where(lse > float("-inf"), tl.exp2(lse - lse_max), 0.0)  # [SPLITS_PAD]
    dims = tl.arange(0, HEAD_DIM_PAD)
    parts = tl.load(partial_out_ptr + (row_base + splits)[:, None] * HEAD_DIM_PAD + dims[None, :],
                    mask=split_valid[:, None], other=0.0)
    total = tl.sum(weight, 0)
    out = tl.sum(parts * weight[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + seq * stride_o_t + head * stride_o_h + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Enough splits for ~2 waves of programs, but none shorter than 4 tiles (host ints only)."""
    programs = max(1, num_seqs * num_kv_heads)
    wanted = -(-2 * num_sms // programs)
    longest = max(1, max_seq_len // (4 * TILE_N))
    return max(1, min(wanted, longest, 64))


def split_kv_attention(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, batch: PagedBatch,
    params: SplitKVParams,
) -> torch.Tensor:
    """Decode query [S, H, d] (token i = sequence i) + paged caches -> [S, H, d]; no host sync."""
    check_paged_inputs(query, key_cache, value_cache, batch)
    assert batch.max_query_len == 1 and query.shape[0] == batch.num_seqs, "split-KV is decode-only"
    num_splits, scale = params.num_splits, params.scale
    assert num_splits >= 1, f"num_splits must be >= 1, got {num_splits}"
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    partial_out = torch.empty(num_seqs, num_heads, num_splits, head_dim_pad, dtype=torch.float32,
                              device=query.device)
    partial_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    _split_kv_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        partial_out, partial_lse, query, key_cache, value_cache, batch.block_tables, batch.seq_lens,
        score_scale(scale, params.kv_scales, key_cache.dtype), num_splits, params.kv_scales.v_scale,
        query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), batch.block_tables.stride(0),
        GROUP=group, ROWS=max(16, triton.next_power_of_2(group)), TILE_N=TILE_N, HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=key_cache.shape[1], KV_FP8=is_fp8(key_cache.dtype), num_warps=4,
        num_stages=2,
    )
    _split_kv_reduce_kernel[(num_seqs, num_heads)](
        out, partial_out, partial_lse, num_splits, out.stride(0), out.stride(1),
        SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)), HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
    )
    return out


def split_kv_attention_ref(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, batch: PagedBatch,
    params: SplitKVParams,
) -> torch.Tensor:
    """float32 reference: attend per span as the kernel cuts them, merge by log-sum-exp."""
    check_paged_inputs(query, key_cache, value_cache, batch)
    assert batch.max_query_len == 1 and query.shape[0] == batch.num_seqs, "split-KV is decode-only"
    parts = [_span_attention_ref(query, key_cache, value_cache, batch, (split, params))
             for split in range(params.num_splits)]
    lse = torch.stack([p[1] for p in parts])  # [splits, S, H]
    weight = torch.softmax(lse, dim=0).nan_to_num(0.0)  # every span empty (seq_len 0) -> weight 0
    return sum(w[..., None] * p[0] for w, p in zip(weight, parts))


def _span_attention_ref(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, batch: PagedBatch,
    split_of: tuple[int, SplitKVParams],
) -> tuple[torch.Tensor, torch.Tensor]:
    """One span per sequence: (normalised output [S, H, d], natural-log lse [S, H], -inf if empty)."""
    split, params = split_of
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    out = torch.zeros(num_seqs, num_heads, head_dim, dtype=torch.float32, device=query.device)
    lse = torch.full((num_seqs, num_heads), float("-inf"), device=query.device)
    for seq, seq_len in enumerate(batch.seq_lens.tolist()):
        span = math.ceil(math.ceil(seq_len / params.num_splits) / TILE_N) * TILE_N
        start, end = split * span, min(split * span + span, seq_len)
        if start >= end:
            continue
        blocks = batch.block_tables[seq, : math.ceil(end / block_size)].long()
        k_scale, v_scale = params.kv_scales.k_scale, params.kv_scales.v_scale
        keys = dequantize_kv(key_cache[blocks].flatten(0, 1)[start:end], torch.float32, k_scale)  # [n, kvh, d]
        values = dequantize_kv(value_cache[blocks].flatten(0, 1)[start:end], torch.float32, v_scale)
        group = num_heads // num_kv_heads
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, n, d]
        values = values.repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (keys @ query[seq].float()[:, :, None]).squeeze(-1) * params.scale  # [H, n]
        lse[seq] = scores.logsumexp(-1)
        out[seq] = (scores.softmax(-1)[:, None, :] @ values).squeeze(1)
    return out, lse
