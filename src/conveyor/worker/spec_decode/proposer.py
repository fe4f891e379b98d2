"""What a proposer is handed after each verified step, and what it must provide.

A proposer drafts the next step's tokens of every request that sampled, from the request's confirmed
tokens (prompt + outputs, the accepted drafts and the target's token of this step included). The
runner calls it once per step, after verification, and tells it which requests the scheduler dropped.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

from conveyor.worker.kv_cache import KVCacheSpec
from conveyor.worker.request_state import RequestState


@dataclass(frozen=True)
class ProposalInputs:
    """One verified step, as proposers see it."""

    batch: Sequence[RequestState]
    """Every request of the step in batch order; token_ids already hold the step's kept tokens, and
    num_computed_tokens is still the step's start (what the scheduler sent)."""
    proposing_rows: list[int]
    """Batch rows of the requests that sampled: each gets drafts for its next step (possibly none)."""
    num_scheduled_tokens: Mapping[str, int]
    """The step's tokens per request (the SchedulerOutput's)."""

    @cached_property
    def context_ends(self) -> list[int]:
        """Per request: the end of the tokens [num_computed_tokens, end) a draft model (re)computes this
        step -- all its known tokens if it sampled, the end of its chunk for a partial prefill. Computed
        on first use: the n-gram lookup never reads it."""
        proposing = set(self.proposing_rows)
        return [len(state.token_ids) if row in proposing
                else state.num_computed_tokens + self.num_scheduled_tokens[state.request_id]
                for row, state in enumerate(self.batch)]


class Proposer(Protocol):
    """A source of draft tokens (n-gram lookup, a draft model)."""

    def propose(self, inputs: ProposalInputs) -> dict[str, list[int]]:
        """Drafts of each of `inputs.proposing_rows` that got some, by request id (absent: none, so a
        step that drafts nothing costs nothing per request here)."""
        ...

    def drop(self, request_ids: Iterable[str]) -> None:
        """Forget requests that finished or were preempted."""
        ...

    @property
    def kv_cache_spec(self) -> KVCacheSpec | None:
        """The geometry of the proposer's own KV cache (a draft model), None if it needs none."""
        ...

    def bind_kv_cache(self, num_blocks: int) -> None:
        """Allocate that cache with the target's number of blocks (both share the block tables)."""
        ...
