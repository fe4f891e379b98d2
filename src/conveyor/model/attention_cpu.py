"""The "cpu" attention backend: decodes and prefill chunks read the paged KV in place (C kernels).

A decode is one query token against its whole context: memory-bound, and on the torch backend its
K/V were first gathered into a padded copy (a full extra pass over K/V per layer) and then read
again by SDPA. Here every decode of the step goes to `paged_decode_attention` in one call, which
walks each sequence's blocks with an online softmax, reading each K/V byte once. Queries of a few
tokens (speculative verification, a prefill's tail) go there too, as one decode per token. Longer
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

from conveyor.kernels.paged_attention_cpu import kernel_supports, paged_decode_attention, paged_prefill_attention
from conveyor.model.attention import TorchAttentionBackend, paged_attention_torch
from conveyor.model.attention_metadata import AttentionMetadata


@dataclass(frozen=True)
class CPUAttentionPlan:
    """What the cpu backend derives from one step's metadata, once, for every layer."""

    decode_token_rows: torch.Tensor
    """[S] int64: the rows in query / out of the tokens the C kernel takes (decodes, short queries)."""
    decode_seq_rows: torch.Tensor
    """[S] int64: their rows in block_tables / seq_lens."""
    block_tables: torch.Tensor
    """[num_seqs + short-query tokens, max_blocks] int32, contiguous (what the kernel indexes)."""
    seq_lens: torch.Tensor
    """[num_seqs + short-query tokens] int32, contiguous: a short query's token j sees seq_len - q + 1 + j keys."""
    prefill_token_starts: torch.Tensor
    """[C] int64: the first row in query / out of each query of more than MAX_PAGED_QUERY tokens."""
    prefill_num_tokens: torch.Tensor
    """[C] int64: their lengths (each is its sequence's last positions)."""
    prefill_seq_rows: torch.Tensor
    """[C] int64: their sequences' rows in block_tables / seq_lens."""


MAX_PAGED_QUERY = 8
"""Queries of up to this many tokens (a speculative verify step's 1 + K, a prefill's last few tokens)
run as that many decodes in the C kernel, token j of the query seeing the context and query tokens
0..j: per layer, gathering the sequence's K/V and a masked SDPA cost more than reading the K/V in
place a few times (it stays in cache after the first)."""


def plan_cpu_attention(metadata: AttentionMetadata) -> CPUAttentionPlan:
    lens = metadata.query_lens_cpu
    starts = [0]
    for length in lens:
        starts.append(starts[-1] + length)
    paged = [i for i, q in enumerate(lens) if 0 < q <= MAX_PAGED_QUERY]
    prefills = [i for i, q in enumerate(lens) if q > MAX_PAGED_QUERY]
    # Token j of a q-token query is a decode of length seq_len - q + 1 + j. Its last token (a plain
    # decode's only one) is the sequence's own row of block_tables / seq_lens; each earlier token gets
    # an extra row after the sequences' rows.
    earlier = [(i, j) for i in paged for j in range(lens[i] - 1)]
    extra_row = iter(range(len(lens), len(lens) + len(earlier)))
    seq_rows = [next(extra_row) if j < lens[i] - 1 else i for i in paged for j in range(lens[i])]
    block_tables = metadata.block_tables.to(torch.int32).contiguous()
    seq_lens = metadata.seq_lens.to(torch.int32).contiguous()
    if earlier:
        block_tables = torch.cat([block_tables, block_tables[torch.tensor([i for i, _ in earlier])]])
        extra_lens = [metadata.seq_lens_cpu[i] - lens[i] + 1 + j for i, j in earlier]
        seq_lens = torch.cat([seq_lens, torch.tensor(extra_lens, dtype=torch.int32)])
    return CPUAttentionPlan(
        decode_token_rows=torch.tensor([starts[i] + j for i in paged for j in range(lens[i])], dtype=torch.int64),
        decode_seq_rows=torch.tensor(seq_rows, dtype=torch.int64),
        block_tables=block_tables, seq_lens=seq_lens,
        prefill_token_starts=torch.tensor([starts[i] for i in prefills], dtype=torch.int64),
        prefill_num_tokens=torch.tensor([lens[i] for i in prefills], dtype=torch.int64),
        prefill_seq_rows=torch.tensor(prefills, dtype=torch.int64),
    )


class CPUAttentionBackend(TorchAttentionBackend):
    """Paged attention for float32 caches on the CPU (decodes and prefill chunks in C, K/V writes in torch)."""

    name = "cpu"

    def forward(
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """query [T, H, d] -> [T, H, d], this step's K/V already written."""
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
        if plan.decode_token_rows.numel():
            paged_decode_attention(query, kv_cache, plan.decode_token_rows, plan.decode_seq_rows,
                                   plan.block_tables, plan.seq_lens, scale, out)
        if plan.prefill_seq_rows.numel():
            paged_prefill_attention(query, kv_cache, plan.prefill_token_starts, plan.prefill_num_tokens,
                                    plan.prefill_seq_rows, plan.block_tables, plan.seq_lens, scale, out)
        return out
