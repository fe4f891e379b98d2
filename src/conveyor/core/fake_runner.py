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

With `speculation`, it also plays speculative decoding as core/outputs.py specifies it: after each
sampled token it proposes a random number of drafts for the request's next step, a random prefix of
which are the tokens it will really produce (the rest wrong), and verifies scheduled drafts greedily
(the longest prefix equal to its own tokens, then its own next token). Outputs therefore equal
sequential decoding whatever the acceptance, while acceptance counts, rollbacks and slot reuse are
random. Draft positions are fed as inputs (their KV fingerprints use the drafts), and like a draft
model (`num_lookahead_tokens` > 0) it drafts only as far as its block table has slots.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

from conveyor.core.outputs import ModelRunnerOutput, SchedulerOutput


def default_token_fn(request_id: str, position: int) -> int:
    """A token id in [1000, 33000): never a small id such as an EOS a test would pick."""
    return 1000 + zlib.crc32(f"{request_id}:{position}".encode()) % 32000


@dataclass(frozen=True)
class FakeSpeculation:
    """How the fake runner drafts (see the module docstring)."""

    num_speculative_tokens: int
    """K: drafts per request and step at most."""
    max_model_len: int
    """No draft at or past this position (as the real proposers)."""
    num_lookahead_tokens: int = 0
    """> 0: draft only where the block table has a slot for the draft's KV (a draft model's rule)."""
    seed: int = 0
    """Seed of the draft counts and of which drafts are right."""


@dataclass
class _WorkerState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    fingerprints: list[int] = field(default_factory=list)  # fingerprints[p]: KV content of position p

    def fingerprint(self, position: int, drafts: list[int] | None = None) -> int:
        """KV content of `position` given the request's tokens followed by `drafts` (never cached)."""
        num_tokens = len(self.token_ids)
        while len(self.fingerprints) <= min(position, num_tokens - 1):
            previous = self.fingerprints[-1] if self.fingerprints else 0
            self.fingerprints.append(hash((previous, self.token_ids[len(self.fingerprints)])))
        if position < num_tokens:
            return self.fingerprints[position]
        assert drafts is not None and position < num_tokens + len(drafts), "a position past the drafts"
        value = self.fingerprints[-1]
        for draft in drafts[: position - num_tokens + 1]:
            value = hash((value, draft))
        return value


@dataclass
class FakeModelRunner:
    """Mirrors a worker's persistent request states; raises AssertionError on a contract violation."""

    block_size: int
    token_fn: Callable[[str, int], int] = default_token_fn
    """Sampled token = token_fn(request id, position of the new token)."""
    check_kv: bool = False
    """Simulate KV contents and check every context read (O(context) per request and step)."""
    speculation: FakeSpeculation | None = None
    """Propose and verify drafts (None: the scheduler must send none)."""
    states: dict[str, _WorkerState] = field(default_factory=dict)
    kv_slots: dict[int, int] = field(default_factory=dict)
    _rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.speculation.seed if self.speculation else 0)

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
        spec_tokens = output.scheduled_spec_decode_tokens
        assert self.speculation is not None or not spec_tokens, "drafts sent with speculation off"
        if self.check_kv:
            for request_id, num_tokens in output.num_scheduled_tokens.items():
                self._write_kv(self.states[request_id], num_tokens, spec_tokens.get(request_id, []))
        sampled: dict[str, list[int]] = {}
        proposals: dict[str, list[int]] = {}
        for request_id, num_tokens in output.num_scheduled_tokens.items():
            sampled[request_id] = self._run(request_id, num_tokens, spec_tokens.get(request_id, []))
            if sampled[request_id] and self.speculation is not None:
                proposals[request_id] = self._propose(request_id, self.speculation)
        return ModelRunnerOutput(sampled, spec_token_ids={k: v for k, v in proposals.items() if v})

    def launch(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """Async scheduling's first half: the fake computes at once (its tokens are a pure function of
        the position, so it never needs the pending step's) and hands the output over in `collect`."""
        return self.execute(output)

    def collect(self, handle: ModelRunnerOutput) -> ModelRunnerOutput:
        return handle

    def _slot(self, state: _WorkerState, position: int) -> int:
        return state.block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def _write_kv(self, state: _WorkerState, num_tokens: int, drafts: list[int]) -> None:
        for position in range(state.num_computed_tokens, state.num_computed_tokens + num_tokens):
            self.kv_slots[self._slot(state, position)] = state.fingerprint(position, drafts)

    def _run(self, request_id: str, num_tokens: int, drafts: list[int]) -> list[int]:
        state = self.states[request_id]
        end = state.num_computed_tokens + num_tokens
        num_known = len(state.token_ids)
        assert 0 < num_tokens and end <= num_known + len(drafts), f"{request_id}: computes unknown tokens"
        assert not drafts or end == num_known + len(drafts), f"{request_id}: its range does not reach its drafts"
        assert len(state.block_ids) * self.block_size >= end, f"{request_id}: too few KV slots"
        if self.check_kv:
            for position in range(end):
                assert self.kv_slots.get(self._slot(state, position)) == state.fingerprint(position, drafts), (
                    f"{request_id}: KV of position {position} is not this request's")
        if end < num_known:
            state.num_computed_tokens = end
            return []  # a partial prefill chunk samples nothing
        kept: list[int] = []  # greedy verification: the drafts equal to its own tokens, then its own next token
        for draft in drafts:
            if draft != self.token_fn(request_id, num_known + len(kept)):
                break
            kept.append(draft)
        kept.append(self.token_fn(request_id, num_known + len(kept)))
        state.token_ids.extend(kept)
        state.num_computed_tokens = len(state.token_ids) - 1  # the contract's rollback, as the scheduler's
        return kept

    def _propose(self, request_id: str, speculation: FakeSpeculation) -> list[int]:
        """A random number of drafts, a random prefix of them right (module docstring)."""
        state, rng = self.states[request_id], self._rng
        end = len(state.token_ids)
        room = speculation.max_model_len - end
        if speculation.num_lookahead_tokens:  # a draft writes KV at end .. end + k - 2
            room = min(room, 1 + len(state.block_ids) * self.block_size - end)
        num_drafts = rng.randint(0, max(0, min(room, speculation.num_speculative_tokens)))
        num_right = rng.randint(0, num_drafts)
        drafts = [self.token_fn(request_id, end + i) for i in range(num_right)]
        while len(drafts) < num_drafts:  # the first is wrong; what follows a wrong one is never checked
            wrong = self.token_fn(request_id, end + len(drafts)) + 1
            drafts.append(wrong if len(drafts) == num_right else rng.choice([wrong, wrong - 1]))
        return drafts
