"""The draft-model proposer: a smaller model with the target's tokenizer drafts K tokens greedily.

The model: the draft keeps its own paged KV cache under the target's block ids (the same block
tables, so the scheduler's allocation and prefix cache cover both), valid exactly where the target's
is. Each step it recomputes every request of the batch from the scheduler's num_computed_tokens (the
step's start) to its context end -- the chunk of a partial prefill; for a request that sampled, all
its confirmed tokens, the accepted drafts and the target's new token included -- so rejected drafts
need no rollback, and a preempted or prefix-cached request nothing special (any block the target
computed, the draft computed in the same step). The logits of a sampling request's last token give
its draft e_0; each further pass feeds e_{j-1} at the next position (one token per request) and
takes the argmax again.

Those passes write the KV of speculative tokens past the context end, so they need slots there: the
scheduler reserves `SpeculativeConfig.num_lookahead_tokens` (= K) slots past each request's
scheduled tokens (vLLM's rule). A request whose block table ends sooner gets fewer drafts, none if
its context end itself has no slot; drafts never reach max_model_len. The passes run eagerly (no
CUDA graphs) and stay on the device until the one copy of all drafts at the end.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from conveyor.model.loader import LoadedModel
from conveyor.worker.input_batch import HostBatch, HostStaging, host_batch, layout_batch
from conveyor.worker.kv_cache import KVCacheSpec, allocate_kv_caches, dtype_num_bytes
from conveyor.worker.sampling_metadata import host_to_device
from conveyor.worker.spec_decode.proposer import ProposalInputs


@dataclass(frozen=True)
class DraftParams:
    """The target-side facts the draft model's passes obey."""

    num_speculative_tokens: int
    """K: drafts per request and step at most."""
    max_model_len: int
    """No draft at or past this position."""
    block_size: int
    """Tokens per KV block (the target's)."""


@dataclass(frozen=True)
class DraftPasses:
    """The host inputs of one step's passes (see the module docstring)."""

    first: HostBatch
    """Pass 0: every request's context range; its logits rows are the drafting requests' last tokens."""
    first_drafters: list[int]
    """Index (into the proposing rows) of each drafting request, in pass-0 logits order."""
    later: list[tuple[HostBatch, list[int]]]
    """Pass j >= 1: (one token per request still drafting, those requests' indices)."""
    counts: list[int]
    """Drafts each proposing request gets."""


def plan_draft_passes(inputs: ProposalInputs, params: DraftParams) -> DraftPasses:
    """All passes' positions, slots and counts from host ints (no token of a later pass is known yet)."""
    batch, block_size = inputs.batch, params.block_size
    capacity = np.array([s.block_table.num_blocks * block_size for s in batch], dtype=np.int64)
    ends = np.array(inputs.context_ends, dtype=np.int64)
    starts = np.array([s.num_computed_tokens for s in batch], dtype=np.int64)
    stops = np.minimum(ends, capacity)  # [B] the KV the draft can write
    layout = layout_batch(starts, stops - starts, [s.block_table for s in batch], block_size)
    input_ids = np.fromiter((t for s, a, b in zip(batch, starts.tolist(), stops.tolist()) for t in s.token_ids[a:b]),
                            dtype=np.int64, count=layout.num_tokens)
    rows = np.array(inputs.proposing_rows, dtype=np.int64)
    room = np.minimum(params.max_model_len - ends[rows], 1 + capacity[rows] - ends[rows])  # [P]
    counts = np.where(stops[rows] == ends[rows], np.clip(room, 0, params.num_speculative_tokens), 0)
    drafters = np.flatnonzero(counts > 0)
    first = host_batch(layout, input_ids, layout.query_start_loc[1:][rows[drafters]] - 1, drafters.tolist())
    later = []
    for step in range(1, params.num_speculative_tokens):
        active = np.flatnonzero(counts > step)  # indices into the proposing rows
        if active.size == 0:
            break
        tables = [batch[row].block_table for row in rows[active].tolist()]
        ones = np.ones(active.size, dtype=np.int64)
        step_layout = layout_batch(ends[rows[active]] + step - 1, ones, tables, block_size)
        later.append((host_batch(step_layout, np.zeros(active.size, dtype=np.int64),
                                 np.arange(active.size, dtype=np.int64), active.tolist()), active.tolist()))
    return DraftPasses(first=first, first_drafters=drafters.tolist(), later=later, counts=counts.tolist())


class DraftModelProposer:
    """Runs the draft model's passes on its own KV cache (see the module docstring)."""

    def __init__(self, loaded: LoadedModel, params: DraftParams, device: torch.device, dtype: torch.dtype) -> None:
        self.model = loaded.module
        self.arch_config = loaded.arch_config
        self.params = params
        self.device = device
        self.dtype = dtype
        self.kv_caches: list[torch.Tensor] = []
        self._staging = [HostStaging(device) for _ in range(params.num_speculative_tokens)]
        """One per pass: a pass never waits for the previous pass's copies out of a shared buffer."""

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        config = self.arch_config
        return KVCacheSpec(num_layers=config.num_hidden_layers, num_kv_heads=config.num_key_value_heads,
                           head_dim=config.head_dim, block_size=self.params.block_size,
                           dtype_bytes=dtype_num_bytes(self.dtype))

    def bind_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_caches(self.kv_cache_spec, num_blocks, self.device, self.dtype)

    def drop(self, request_ids: Iterable[str]) -> None:
        """Nothing to forget: the draft's KV follows the scheduler's num_computed_tokens."""

    @torch.inference_mode()
    def propose(self, inputs: ProposalInputs) -> dict[str, list[int]]:
        if not self.kv_caches:
            raise RuntimeError("the draft model's KV cache is not allocated (bind_kv_cache)")
        if not inputs.batch:
            return {}
        passes = plan_draft_passes(inputs, self.params)
        drafts = torch.zeros(len(inputs.proposing_rows), self.params.num_speculative_tokens,
                             dtype=torch.int64, device=self.device)  # [P, K]
        first = self._forward(passes.first, 0, None)
        if passes.first_drafters:
            drafts[self._index(passes.first_drafters), 0] = first
        for step, (host, active) in enumerate(passes.later, start=1):
            rows = self._index(active)
            drafts[rows, step] = self._forward(host, step, drafts[rows, step - 1])
        return {inputs.batch[row].request_id: request_drafts[:count]
                for row, request_drafts, count in zip(inputs.proposing_rows, drafts.tolist(), passes.counts) if count}

    def _index(self, rows: list[int]) -> torch.Tensor:
        return host_to_device(rows, torch.int64, self.device)

    def _forward(self, host: HostBatch, step: int, input_ids: torch.Tensor | None) -> torch.Tensor:
        """Greedy tokens [N] at the pass's logits rows; `input_ids` [T] replaces the host's placeholders."""
        inputs = self._staging[step].device_batch(host, self.params.block_size)
        if input_ids is not None:
            inputs.input_ids.copy_(input_ids)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attention)  # [T, H]
        if host.logits_indices.size == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return self.model.compute_logits(hidden[inputs.logits_indices]).argmax(dim=-1)  # [N]
