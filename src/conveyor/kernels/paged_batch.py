"""The batch geometry the paged-attention kernels read, and the float32 reference they are checked against.

A step is a flat list of query tokens of `num_seqs` sequences (vLLM's varlen layout): sequence `i` owns
tokens `query_start_loc[i]:query_start_loc[i+1]`, which are its last positions up to `seq_lens[i] - 1`;
the earlier `seq_lens[i] - query_len_i` positions (prefix-cache hit, earlier chunks) and the new ones
are all read from the paged cache through `block_tables[i]` (the new K/V were stored first). Query
token at position p sees keys 0..p. Query head h reads KV head h // (num_heads // num_kv_heads).
The caches have the query's dtype, or an FP8 dtype (--kv-cache-dtype fp8) read back as value x scale
(kernels/fp8_kv.py) before any product with the query.
"""

import math
from dataclasses import dataclass

import torch

from conveyor.kernels.fp8_kv import UNIT_KV_SCALES, KVScales, dequantize_kv, is_fp8


@dataclass(frozen=True)
class PagedBatch:
    """Device tensors and host bounds of one step's batch (no host sync needed to launch a kernel)."""

    block_tables: torch.Tensor
    """[num_seqs, max_num_blocks] int32: physical block ids per sequence."""
    seq_lens: torch.Tensor
    """[num_seqs] int32: context length including this step's tokens (0 for a padding sequence)."""
    query_start_loc: torch.Tensor
    """[num_seqs + 1] int32: cumulative query lengths."""
    max_query_len: int
    """Longest query in the batch (host int; picks the kernel's tile shape)."""
    max_seq_len: int
    """Longest context in the batch (host int; picks the number of KV splits)."""

    @property
    def num_seqs(self) -> int:
        return self.block_tables.shape[0]


def check_paged_inputs(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       batch: PagedBatch) -> None:
    """Assert the shapes, dtypes and strides every paged-attention kernel relies on."""
    assert query.dim() == 3, f"query must be [T, num_heads, head_dim], got {tuple(query.shape)}"
    assert key_cache.dim() == 4 and value_cache.shape == key_cache.shape, "caches [nb, block_size, kvh, d]"
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = key_cache.shape[2]
    assert key_cache.shape[3] == head_dim, f"cache head_dim {key_cache.shape[3]} != query {head_dim}"
    assert num_heads % num_kv_heads == 0, f"num_heads {num_heads} not a multiple of kvh {num_kv_heads}"
    assert query.stride(2) == 1 and key_cache.stride(3) == 1 and value_cache.stride(3) == 1, "d contiguous"
    assert key_cache.dtype == value_cache.dtype, f"K/V caches {key_cache.dtype} / {value_cache.dtype}"
    assert key_cache.dtype == query.dtype or is_fp8(key_cache.dtype), "caches have the query's dtype or FP8"
    num_seqs = batch.num_seqs
    assert batch.seq_lens.shape == (num_seqs,), f"seq_lens [{num_seqs}], got {batch.seq_lens.shape}"
    assert batch.query_start_loc.shape == (num_seqs + 1,), "query_start_loc must be [num_seqs + 1]"
    for name in ("block_tables", "seq_lens", "query_start_loc"):
        tensor = getattr(batch, name)
        assert tensor.dtype == torch.int32, f"{name} must be int32, got {tensor.dtype}"
        assert tensor.device == query.device, f"{name} on {tensor.device}, query on {query.device}"
    assert batch.block_tables.stride(1) == 1, "block_tables rows must be contiguous"


def paged_attention_ref(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, batch: PagedBatch,
    scale: float, *, kv_scales: KVScales = UNIT_KV_SCALES,
) -> torch.Tensor:
    """float32 reference, one sequence at a time: query [T, H, d] -> [T, H, d] float32 (FP8 caches
    dequantized with `kv_scales`)."""
    check_paged_inputs(query, key_cache, value_cache, batch)
    num_heads = query.shape[1]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    k_scale, v_scale = kv_scales.k_scale, kv_scales.v_scale
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    starts = batch.query_start_loc.tolist()
    for seq, seq_len in enumerate(batch.seq_lens.tolist()):
        first, last = starts[seq], starts[seq + 1]
        if seq_len == 0 or first == last:
            continue
        blocks = batch.block_tables[seq, : math.ceil(seq_len / block_size)].long()
        keys = dequantize_kv(key_cache[blocks].flatten(0, 1)[:seq_len], torch.float32, k_scale)  # [L, kvh, d]
        values = dequantize_kv(value_cache[blocks].flatten(0, 1)[:seq_len], torch.float32, v_scale)
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, d]
        values = values.repeat_interleave(group, dim=1).transpose(0, 1)
        q = query[first:last].float().transpose(0, 1)  # [H, q, d]
        scores = q @ keys.transpose(1, 2) * scale  # [H, q, L]
        query_pos = torch.arange(seq_len - (last - first), seq_len, device=query.device)
        visible = torch.arange(seq_len, device=query.device)[None, :] <= query_pos[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[first:last] = (scores.softmax(-1) @ values).transpose(0, 1)
    return out
