"""The "cpu" attention backend: decodes and prefill chunks read the paged KV in place (C kernels).

A decode is one query token against its whole context: memory-bound, and on the torch backend its
K/V were first gathered into a padded copy (a full extra pass over K/V per layer) and then read
again by SDPA. Here every decode of the step goes to `paged_decode_attention` in one call, which
walks each sequence's blocks with an online softmax, reading each K/V byte once. Queries of up to
MAX_QUERY_TOKENS (8) tokens -- a speculative verify step's 1 + K, a prefill's tail -- go there too,
their tokens sharing each read of the K/V (as 4 separate decodes, a 4-token verify over a 1,000-token
context took 12 ms of attention per step on 30 layers; one read: see docs/performance.md). Longer
prefill chunks go to `paged_prefill_attention`, also in one call: causal, tiles of query tokens
sharing each key row, no gathered copy and no [q, L] mask -- torch's fused SDPA needed both after a
cached context and computed the masked half there (a 900-token chunk after 500 cached tokens: 97 ->
73 ms per layer, 2 chunks, 1 thread; from position 0, 39 -> 32 ms). The step's index tensors are
planned once, by the first layer, and reused by the other layers. Geometries the kernels do not take
(head_dim not a multiple of 16 or over 256, over 16 query heads per KV head) run the torch backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conveyor.kernels.fp8_kv import UNIT_KV_SCALES, KVScales
from conveyor.kernels.paged_attention_cpu import (
    MAX_QUERY_TOKENS,
    kernel_supports,
    paged_decode_attention,
    paged_prefill_attention,
)
from conveyor.model.attention import TorchAttentionBackend, paged_attention_torch
from conveyor.model.attention_metadata import AttentionMetadata


@dataclass(frozen=True)
class CPUAttentionPlan:
    """What the cpu backend derives from one step's metadata, once, for every layer. A query is one
    sequence's tokens of the step: [C] int64 tensors per kind (its first row in query / out, its
    length, its row in block_tables / seq_lens)."""

    short_token_starts: torch.Tensor
    """Queries of up to MAX_QUERY_TOKENS tokens (decodes, verify steps, prefill tails): the decode kernel."""
    short_num_tokens: torch.Tensor
    short_seq_rows: torch.Tensor
    prefill_token_starts: torch.Tensor
    """Longer queries (prefill chunks): the prefill kernel."""
    prefill_num_tokens: torch.Tensor
    prefill_seq_rows: torch.Tensor
    block_tables: torch.Tensor
    """[num_seqs, max_blocks] int32, contiguous (what the kernels index)."""
    seq_lens: torch.Tensor
    """[num_seqs] int32, contiguous."""


def plan_cpu_attention(metadata: AttentionMetadata) -> CPUAttentionPlan:
    lens = metadata.query_lens_cpu
    starts = [0]
    for length in lens:
        starts.append(starts[-1] + length)
    short = [i for i, q in enumerate(lens) if 0 < q <= MAX_QUERY_TOKENS]
    prefills = [i for i, q in enumerate(lens) if q > MAX_QUERY_TOKENS]

    def as_tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64)

    return CPUAttentionPlan(
        short_token_starts=as_tensor([starts[i] for i in short]), short_num_tokens=as_tensor([lens[i] for i in short]),
        short_seq_rows=as_tensor(short), prefill_token_starts=as_tensor([starts[i] for i in prefills]),
        prefill_num_tokens=as_tensor([lens[i] for i in prefills]), prefill_seq_rows=as_tensor(prefills),
        block_tables=metadata.block_tables.to(torch.int32).contiguous(),
        seq_lens=metadata.seq_lens.to(torch.int32).contiguous(),
    )


class CPUAttentionBackend(TorchAttentionBackend):
    """Paged attention for float32 caches on the CPU (decodes and prefill chunks in C, K/V writes in torch)."""

    name = "cpu"

    def forward(
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
        kv_scales: KVScales = UNIT_KV_SCALES,
    ) -> torch.Tensor:
        """query [T, H, d] -> [T, H, d], this step's K/V already written (float32: `kv_scales` unused)."""
        if kv_cache.dtype != torch.float32 or kv_cache.device.type != "cpu":
            raise ValueError(f"the cpu attention backend needs a float32 CPU KV cache (got {kv_cache.dtype} on "
                             f"{kv_cache.device}); use the torch backend")
        if not kernel_supports(query.shape[1], kv_cache.shape[-2], query.shape[-1]):
            return paged_attention_torch(query, kv_cache, metadata, scale)
        plan = metadata.backend_plan
        if not isinstance(plan, CPUAttentionPlan):  # first layer of the step: plan once
            plan = metadata.backend_plan = plan_cpu_attention(metadata)
        query = query.contiguous()
        out = torch.empty_like(query)
        if plan.short_seq_rows.numel():
            paged_decode_attention(query, kv_cache, plan.short_token_starts, plan.short_num_tokens,
                                   plan.short_seq_rows, plan.block_tables, plan.seq_lens, scale, out)
        if plan.prefill_seq_rows.numel():
            paged_prefill_attention(query, kv_cache, plan.prefill_token_starts, plan.prefill_num_tokens,
                                    plan.prefill_seq_rows, plan.block_tables, plan.seq_lens, scale, out)
        return out
