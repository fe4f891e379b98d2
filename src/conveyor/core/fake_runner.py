"""A deterministic stand-in for the worker: it keeps the worker's per-request state from the
`SchedulerOutput` deltas alone, checks the contract, and "samples" a token that is a pure function of
(request id, position), so runs are reproducible and identical with or without chunking, prefix caching
or preemption. Used by the tests and the simulation; it never loads a model.

With `check_kv`, it also plays the KV cache: computing position p of a request writes a fingerprint of
the request's tokens [0, p] into p's slot (block_ids[p // block_size], p % block_size); before
sampling, every context position must hold the fingerprint this request's own tokens would produce.
Prefix-cache hits, block tables, preemption and block reuse are thereby checked end to end. As on a
GPU, all of a step's writes land before any read (a request may hit blocks another one fills in the
same step).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

from conveyor.core.outputs import ModelRunnerOutput, SchedulerOutput


def default_token_fn(request_id: str, position: int) -> int:
    """A token id in [1000, 33000): never a small id such as an EOS a test would pick."""
    return 1000 + zlib.crc32(f"{request_id}:{position}".encode()) % 32000


@dataclass
class _WorkerState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    fingerprints: list[int] = field(default_factory=list)  # fingerprints[p]: KV content of position p

    def fingerprint(self, position: int) -> int:
        while len(self.fingerprints) <= position:
            previous = self.fingerprints[-1] if self.fingerprints else 0
            self.fingerprints.append(hash((previous, self.token_ids[len(self.fingerprints)])))
        return self.fingerprints[position]


@dataclass
class FakeModelRunner:
    """Mirrors a worker's persistent request states; raises AssertionError on a contract violation."""

    block_size: int
    token_fn: Callable[[str, int], int] = default_token_fn
    """Sampled token = token_fn(request id, position of the new token)."""
    check_kv: bool = False
    """Simulate KV contents and check every context read (O(context) per request and step)."""
    states: dict[str, _WorkerState] = field(default_factory=dict)
    kv_slots: dict[int, int] = field(default_factory=dict)

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in output.finished_req_ids | output.preempted_req_ids:
            self.states.pop(request_id, None)
        for new in output.scheduled_new_reqs:
            assert new.request_id not in self.states, f"{new.request_id} sent as new twice"
            self.states[new.request_id] = _WorkerState(
                list(new.prompt_token_ids) + list(new.output_token_ids), list(new.block_ids),
                new.num_computed_tokens)
        cached = output.scheduled_cached_reqs
        for request_id, new_block_ids, num_computed_tokens in zip(cached.req_ids, cached.new_block_ids,
                                                                  cached.num_computed_tokens):
            state = self.states[request_id]
            assert state.num_computed_tokens == num_computed_tokens, "worker/scheduler out of sync"
            state.block_ids.extend(new_block_ids)
        if self.check_kv:
            for request_id, num_tokens in output.num_scheduled_tokens.items():
                self._write_kv(self.states[request_id], num_tokens)
        sampled: dict[str, list[int]] = {}
        for request_id, num_tokens in output.num_scheduled_tokens.items():
            sampled[request_id] = self._run(request_id, num_tokens)
        return ModelRunnerOutput(sampled)

    def launch(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """Async scheduling's first half: the fake computes at once (its tokens are a pure function of
        the position, so it never needs the pending step's) and hands the output over in `collect`."""
        return self.execute(output)

    def collect(self, handle: ModelRunnerOutput) -> ModelRunnerOutput:
        return handle

    def _slot(self, state: _WorkerState, position: int) -> int:
        return state.block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def _write_kv(self, state: _WorkerState, num_tokens: int) -> None:
        for position in range(state.num_computed_tokens, state.num_computed_tokens + num_tokens):
            self.kv_slots[self._slot(state, position)] = state.fingerprint(position)

    def _run(self, request_id: str, num_tokens: int) -> list[int]:
        state = self.states[request_id]
        end = state.num_computed_tokens + num_tokens
        assert 0 < num_tokens and end <= len(state.token_ids), f"{request_id}: computes unknown tokens"
        assert len(state.block_ids) * self.block_size >= end, f"{request_id}: too few KV slots"
        if self.check_kv:
            for position in range(end):
                assert self.kv_slots.get(self._slot(state, position)) == state.fingerprint(position), (
                    f"{request_id}: KV of position {position} is not this request's")
        state.num_computed_tokens = end
        if end < len(state.token_ids):
            return []  # a partial prefill chunk samples nothing
        token_id = self.token_fn(request_id, end)
        state.token_ids.append(token_id)
        return [token_id]
