"""Builders for paged-attention tests: random sequences scattered into a paged cache, and a dense oracle."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from conveyor.kernels.paged_batch import PagedBatch
from conveyor.kernels.store_kv import store_kv_ref


@dataclass(frozen=True)
class Shape:
    """One test case's geometry."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    query_lens: tuple[int, ...]
    """Query tokens per sequence this step."""
    context_lens: tuple[int, ...]
    """Cached tokens per sequence before this step."""


@dataclass
class PagedCase:
    """A batch with its cache filled, plus the contiguous K/V it came from (for the dense oracle)."""

    query: torch.Tensor  # [T, H, d]
    key_cache: torch.Tensor  # [nb, bs, kvh, d]
    value_cache: torch.Tensor
    batch: PagedBatch
    keys: list[torch.Tensor]  # per sequence [L, kvh, d]
    values: list[torch.Tensor]


def make_case(shape: Shape, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0) -> PagedCase:
    """Random K/V for every position of every sequence, stored through shuffled block tables."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(shape.query_lens, shape.context_lens)]
    blocks_per_seq = [math.ceil(n / shape.block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks stay random, never read
    order = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    tail = 0
    for seq, count in enumerate(blocks_per_seq):
        table[seq, :count] = torch.tensor(order[tail : tail + count], dtype=torch.int32)
        tail += count
    cache_shape = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    key_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    value_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    keys = [torch.randn(n, shape.num_kv_heads, shape.head_dim, generator=gen).to(dtype) for n in seq_lens]
    values = [torch.randn(n, shape.num_kv_heads, shape.head_dim, generator=gen).to(dtype) for n in seq_lens]
    for seq, n in enumerate(seq_lens):
        positions = torch.arange(n)
        slots = table[seq, positions // shape.block_size].long() * shape.block_size + positions % shape.block_size
        store_kv_ref(keys[seq], values[seq], key_cache, value_cache, slots)
    starts = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(shape.query_lens, dtype=torch.int32), 0)
    query = torch.randn(int(starts[-1]), shape.num_heads, shape.head_dim, generator=gen).to(dtype)
    batch = PagedBatch(
        block_tables=table.to(device), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=starts.to(device), max_query_len=max(shape.query_lens), max_seq_len=max(seq_lens),
    )
    return PagedCase(query.to(device), key_cache.to(device), value_cache.to(device), batch,
                     [k.to(device) for k in keys], [v.to(device) for v in values])


def dense_attention(case: PagedCase, scale: float) -> torch.Tensor:
    """Naive float32 causal attention per sequence on the contiguous K/V (no paging at all)."""
    outs = []
    starts = case.batch.query_start_loc.tolist()
    for seq, (keys, values) in enumerate(zip(case.keys, case.values)):
        q = case.query[starts[seq] : starts[seq + 1]].float()  # [q, H, d]
        group = q.shape[1] // keys.shape[1]
        k = keys.float().repeat_interleave(group, 1)  # [L, H, d]
        v = values.float().repeat_interleave(group, 1)
        seq_len, query_len = k.shape[0], q.shape[0]
        scores = torch.einsum("qhd,lhd->hql", q, k) * scale
        mask = torch.arange(seq_len)[None, :] > torch.arange(seq_len - query_len, seq_len)[:, None]
        scores = scores.masked_fill(mask.to(scores.device), float("-inf"))
        outs.append(torch.einsum("hql,lhd->qhd", scores.softmax(-1), v))
    return torch.cat(outs)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())
