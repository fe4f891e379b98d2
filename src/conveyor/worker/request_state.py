"""The worker's persistent per-request state, updated from each `SchedulerOutput` (core/outputs.py).

The worker holds every running request's tokens and block table; the scheduler sends only what
changed (new requests in full, blocks appended to known ones) and the worker appends the tokens
it samples itself. Invariant after `apply_scheduler_output`: every scheduled request id has a state,
and none of the finished or preempted ids has one (a preempted request comes back as new, with its
earlier outputs among its tokens, and is recomputed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from conveyor.core.outputs import NewRequestData, SchedulerOutput
from conveyor.sampling_params import SamplingParams


class BlockTable:
    """A request's block ids in a growable int32 numpy buffer: the step's table copies rows from it."""

    def __init__(self, block_ids: list[int]) -> None:
        self._buffer = np.zeros(max(8, 2 * len(block_ids)), dtype=np.int32)
        self._buffer[: len(block_ids)] = block_ids
        self.num_blocks = len(block_ids)
        self.ids = self._buffer[: self.num_blocks]
        """[num_blocks] int32 view of the ids (kept as an attribute: cheaper than slicing per step)."""

    def extend(self, block_ids: list[int]) -> None:
        end = self.num_blocks + len(block_ids)
        if end > self._buffer.shape[0]:
            grown = np.zeros(2 * end, dtype=np.int32)
            grown[: self.num_blocks] = self._buffer[: self.num_blocks]
            self._buffer = grown
        self._buffer[self.num_blocks : end] = block_ids
        self.num_blocks = end
        self.ids = self._buffer[:end]


@dataclass
class RequestState:
    """One request as the worker sees it."""

    request_id: str
    token_ids: list[int]
    """Prompt + output tokens known so far (the worker appends what it samples)."""
    num_prompt_tokens: int
    """How many of token_ids are prompt."""
    block_table: BlockTable
    """Physical block of each block_size-token span of the request, in order."""
    sampling_params: SamplingParams
    num_computed_tokens: int
    """Tokens whose KV is in the cache before the current step (as the scheduler last said)."""
    generator: torch.Generator | None = None
    """The request's own sampling generator (seeded requests only)."""
    draft_generators: list[torch.Generator] = field(default_factory=list)
    """Seeded requests under speculative decoding: one more generator per verified draft position
    (position i of a step draws from the stream of output position num_output_tokens + i)."""

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


def state_from_new(new: NewRequestData, generator: torch.Generator | None) -> RequestState:
    return RequestState(
        request_id=new.request_id,
        token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
        num_prompt_tokens=len(new.prompt_token_ids),
        block_table=BlockTable(new.block_ids),
        sampling_params=new.sampling_params,
        num_computed_tokens=new.num_computed_tokens,
        generator=generator,
    )


def apply_scheduler_output(
    states: dict[str, RequestState],
    scheduler_output: SchedulerOutput,
    make_generator: Callable[[SamplingParams], torch.Generator | None],
) -> list[RequestState]:
    """Drop finished/preempted states, add new ones, extend block tables; returns the batch in order."""
    for request_id in scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids:
        states.pop(request_id, None)
    batch: list[RequestState] = []
    cached = scheduler_output.scheduled_cached_reqs
    for request_id, new_block_ids, num_computed_tokens in zip(cached.req_ids, cached.new_block_ids,
                                                              cached.num_computed_tokens):
        state = states.get(request_id)
        if state is None:
            raise KeyError(
                f"scheduler sent cached request {request_id!r} that the worker does not hold "
                "(a preempted or new request must arrive as NewRequestData)"
            )
        if new_block_ids:
            state.block_table.extend(new_block_ids)
        state.num_computed_tokens = num_computed_tokens
        batch.append(state)
    for new in scheduler_output.scheduled_new_reqs:
        state = state_from_new(new, make_generator(new.sampling_params))
        states[new.request_id] = state
        batch.append(state)
    return batch
