"""What the attention layers need to know about one step's batch, passed explicitly to the model.

There is no prefill phase and no decode phase: one step is a flat list of `num_tokens` query tokens
belonging to `num_seqs` sequences (vLLM's varlen layout). Sequence `i` owns the query tokens
`query_start_loc[i]:query_start_loc[i+1]`; they are its positions
`seq_lens[i] - query_len_i ... seq_lens[i] - 1`, so the first `seq_lens[i] - query_len_i` tokens
(its computed context: a prefix-cache hit or earlier chunks) already have K/V in the paged cache.
A decode is simply a sequence with query length 1. Sequences may appear in any order.

Every token's K/V is written to `slot_mapping[t] = block_id * block_size + offset` before attention
runs, so a query attends to cached context and to its own chunk through the same block table.
All tensors live on the model's device; the `*_cpu` lists mirror them for host-side loops (the
torch backend) and must agree with them. One object describes one step: build a new one per step
(a backend may cache per-step derived data in `backend_plan`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """One step's batch geometry, flattened over tokens (see the module docstring)."""

    query_start_loc: torch.Tensor
    """[num_seqs + 1] int32: cumulative query lengths, query_start_loc[0] == 0."""
    seq_lens: torch.Tensor
    """[num_seqs] int32: context length of each sequence including this step's tokens."""
    block_tables: torch.Tensor
    """[num_seqs, max_num_blocks] int32: physical block ids per sequence, right-padded with 0."""
    slot_mapping: torch.Tensor
    """[num_tokens] int64: cache slot receiving each query token's K/V. A negative slot marks a
    CUDA-graph padding token (the triton backend skips it); the torch backend needs all slots valid."""
    max_query_len: int
    """Longest query (chunk) length in the batch."""
    max_seq_len: int
    """Longest context length in the batch."""
    query_lens_cpu: list[int]
    """Host copy of the per-sequence query lengths (len num_seqs)."""
    seq_lens_cpu: list[int]
    """Host copy of `seq_lens` (len num_seqs)."""
    block_size: int
    """Tokens per KV block (the cache's second dimension)."""
    backend_plan: object | None = None
    """What an attention backend derives from these fields once per step and reuses in every
    layer (index tensors, masks); set by the backend on first use, left None by whoever builds this."""

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens_cpu))

    @property
    def num_decode_tokens(self) -> int:
        """Sequences with exactly one query token (decodes, or a one-token prefill chunk)."""
        return sum(1 for q in self.query_lens_cpu if q == 1)

    @property
    def num_prefills(self) -> int:
        """Sequences with more than one query token."""
        return sum(1 for q in self.query_lens_cpu if q > 1)


@dataclass(frozen=True)
class SequenceSpec:
    """One sequence of a batch, as a metadata builder takes it (tests and simple runners)."""

    num_query_tokens: int
    """Tokens computed this step."""
    seq_len: int
    """Context length after this step (computed tokens + num_query_tokens)."""
    block_ids: list[int]
    """Physical blocks of the sequence, covering at least seq_len tokens."""


def build_attention_metadata(
    seqs: list[SequenceSpec], block_size: int, device: torch.device | str
) -> AttentionMetadata:
    """Metadata for `seqs` in batch order; slot_mapping points each new token at its block slot."""
    if not seqs:
        raise ValueError("build_attention_metadata needs at least one sequence")
    query_lens = [s.num_query_tokens for s in seqs]
    seq_lens = [s.seq_len for s in seqs]
    for index, s in enumerate(seqs):
        if not 1 <= s.num_query_tokens <= s.seq_len:
            raise ValueError(f"seqs[{index}]: need 1 <= num_query_tokens <= seq_len, got {s}")
        if len(s.block_ids) * block_size < s.seq_len:
            raise ValueError(f"seqs[{index}]: {len(s.block_ids)} blocks cannot hold {s.seq_len} tokens")
    max_num_blocks = max(len(s.block_ids) for s in seqs)
    table = torch.zeros(len(seqs), max_num_blocks, dtype=torch.int32)
    for index, s in enumerate(seqs):
        table[index, : len(s.block_ids)] = torch.tensor(s.block_ids, dtype=torch.int32)
    starts = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0)
    slots = _slot_mapping(table, query_lens, seq_lens, block_size)
    return AttentionMetadata(
        query_start_loc=starts.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=table.to(device),
        slot_mapping=slots.to(device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        block_size=block_size,
    )


def _slot_mapping(
    table: torch.Tensor, query_lens: list[int], seq_lens: list[int], block_size: int
) -> torch.Tensor:
    """[num_tokens] int64 slots of each sequence's last query_len positions."""
    rows = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)])
    blocks = table[rows, positions // block_size].long()  # [num_tokens]
    return blocks * block_size + positions % block_size


def positions_of(metadata: AttentionMetadata) -> torch.Tensor:
    """[num_tokens] int64 positions implied by the metadata (on the CPU)."""
    return torch.cat(
        [torch.arange(s - q, s) for q, s in zip(metadata.query_lens_cpu, metadata.seq_lens_cpu)]
    )
