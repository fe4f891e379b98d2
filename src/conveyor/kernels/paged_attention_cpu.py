"""Paged attention on the CPU (kernels/cpu/paged_attention.c, paged_prefill.c): wrappers, torch references.

The model: every decode token (a sequence with one query token) attends to its sequence's
`seq_len` cached keys, read in place through its block table with an online softmax: K/V are read
once, never gathered into a padded copy. A prefill chunk (its sequence's last q positions) attends
causally the same way, tiles of query tokens sharing each key row. GQA: query head h reads KV head
h // (H // KVH).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from conveyor.kernels.cpu_build import cpu_kernels

MAX_HEAD_DIM = 256
"""Largest head_dim the C kernel takes (a multiple of 16)."""
MAX_GROUP = 16
"""Most query heads per KV head the C kernel takes."""


def kernel_supports(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether `paged_decode_attention` takes this geometry."""
    return (head_dim % 16 == 0 and head_dim <= MAX_HEAD_DIM and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= MAX_GROUP)


def _check_paged_args(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, out: torch.Tensor) -> None:
    num_heads, head_dim = query.shape[1:]
    num_kv_heads, cache_head_dim = kv_cache.shape[-2:]
    assert cache_head_dim == head_dim and kernel_supports(num_heads, num_kv_heads, head_dim), (
        f"{num_heads} heads, {num_kv_heads} KV heads, head_dim {head_dim}")
    assert query.dtype == kv_cache.dtype == out.dtype == torch.float32
    assert query.is_contiguous() and kv_cache.is_contiguous() and out.is_contiguous() and out.shape == query.shape
    assert block_tables.dtype == seq_lens.dtype == torch.int32 and block_tables.is_contiguous()
    assert all(t.device.type == "cpu" for t in (query, kv_cache, block_tables, seq_lens, out))


MAX_QUERY_TOKENS = 8
"""Most tokens of one query `paged_decode_attention` takes (a verify step's 1 + K, a prefill's tail)."""


def paged_decode_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, token_starts: torch.Tensor, num_tokens: torch.Tensor,
    seq_rows: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, out: torch.Tensor,
) -> None:
    """Write out[rows of query c] = attention of query rows [token_starts[c], + num_tokens[c]) -- the
    last num_tokens[c] (1 to MAX_QUERY_TOKENS) positions of sequence seq_rows[c], token t seeing
    seq_len - num_tokens + 1 + t keys -- over the paged KV, its K/V read once per query.

    kv_cache [2, num_blocks, block_size, KVH, D] float32; token_starts, num_tokens, seq_rows [C] int64;
    block_tables [num_seqs, max_blocks] int32 and seq_lens [num_seqs] int32.
    """
    status = _launch("paged_decode_attention", query, kv_cache, token_starts, num_tokens, seq_rows, block_tables, seq_lens, scale, out)
    assert status == 0, "paged_decode_attention rejected its geometry or a query's length"


def _check_queries(token_starts: torch.Tensor, num_tokens: torch.Tensor, seq_rows: torch.Tensor) -> None:
    assert token_starts.dtype == num_tokens.dtype == seq_rows.dtype == torch.int64
    assert token_starts.shape == num_tokens.shape == seq_rows.shape
    assert token_starts.is_contiguous() and num_tokens.is_contiguous() and seq_rows.is_contiguous()


def _launch(
    kernel: str, query: torch.Tensor, kv_cache: torch.Tensor, token_starts: torch.Tensor, num_tokens: torch.Tensor,
    seq_rows: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, out: torch.Tensor,
) -> int:
    """Check the arguments both kernels share (one signature: queries over the paged KV) and call `kernel`."""
    _check_paged_args(query, kv_cache, block_tables, seq_lens, out)
    _check_queries(token_starts, num_tokens, seq_rows)
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    status: int = getattr(cpu_kernels(), kernel)(
        query.data_ptr(), kv_cache.data_ptr(), token_starts.data_ptr(), num_tokens.data_ptr(), seq_rows.data_ptr(),
        block_tables.data_ptr(), block_tables.shape[1], seq_lens.data_ptr(), token_starts.numel(),
        query.shape[1], num_kv_heads, head_dim, block_size, num_blocks, scale, out.data_ptr(), torch.get_num_threads(),
    )
    return status


def paged_prefill_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, token_starts: torch.Tensor, num_tokens: torch.Tensor,
    seq_rows: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, out: torch.Tensor,
) -> None:
    """Write out[rows of chunk c] = causal attention of query rows [token_starts[c], + num_tokens[c]),
    the last num_tokens[c] positions of sequence seq_rows[c], over its seq_lens keys in the paged KV.

    token_starts, num_tokens, seq_rows [C] int64; the other tensors as in `paged_decode_attention`.
    """
    status = _launch("paged_prefill_attention", query, kv_cache, token_starts, num_tokens, seq_rows, block_tables, seq_lens, scale, out)
    if status == 2:
        raise MemoryError("paged_prefill_attention could not allocate its tile list")
    assert status == 0, "paged_prefill_attention rejected its geometry"


def paged_prefill_attention_ref(
    query: torch.Tensor, kv_cache: torch.Tensor, token_starts: torch.Tensor, num_tokens: torch.Tensor,
    seq_rows: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, out: torch.Tensor,
) -> None:
    """Torch reference of `paged_prefill_attention`: per chunk, gather its keys, SDPA with a causal mask."""
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    for start, count, seq in zip(token_starts.tolist(), num_tokens.tolist(), seq_rows.tolist()):
        seq_len = int(seq_lens[seq])
        blocks = block_tables[seq, : -(-seq_len // block_size)].long()
        k, v = (kv_cache[i][blocks].flatten(0, 1)[:seq_len].transpose(0, 1) for i in (0, 1))  # [KVH, L, D]
        q = query[start:start + count].view(count, num_kv_heads, -1, query.shape[-1]).permute(1, 2, 0, 3)
        allowed = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - count, seq_len)[:, None]  # [q, L]
        o = F.scaled_dot_product_attention(q, k[:, None], v[:, None], attn_mask=allowed, scale=scale)
        out[start:start + count] = o.permute(2, 0, 1, 3).reshape(count, *query.shape[1:])


def paged_decode_attention_ref(
    query: torch.Tensor, kv_cache: torch.Tensor, token_starts: torch.Tensor, num_tokens: torch.Tensor,
    seq_rows: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, out: torch.Tensor,
) -> None:
    """Torch reference of `paged_decode_attention`: the same causal attention as a prefill's."""
    paged_prefill_attention_ref(query, kv_cache, token_starts, num_tokens, seq_rows, block_tables, seq_lens,
                                scale, out)
