"""Test helpers for speculative decoding in the model runner: a toy scheduler that keeps the spec contract.

`SpecScheduler` extends the toy scheduler of runner_harness with what core/outputs.py asks of a real
one: the drafts a request got in the last ModelRunnerOutput are scheduled with its next decode (1 +
len(drafts) tokens, trimmed so that max_tokens is never passed), `lookahead` slots are allocated past
the scheduled tokens (a draft model writes its proposals' KV there), and after the step
num_computed_tokens = before + scheduled - rejected drafts. It counts drafts and accepted tokens, and
checks after every step that the worker's tokens and the scheduler's agree.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

import torch
from runner_harness import BLOCK_SIZE, ToyScheduler, sharpen

from conveyor.config import CacheConfig, DeviceConfig, LoadFormat, ModelConfig, SchedulerConfig, SpeculativeConfig
from conveyor.core.outputs import CachedRequestData, ModelRunnerOutput, SchedulerOutput
from conveyor.worker.model_runner import ModelRunner


@dataclass
class SpecStats:
    num_drafts: int = 0
    """Draft tokens verified."""
    num_accepted: int = 0
    """Of those, accepted."""

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafts if self.num_drafts else 0.0


def make_spec_runner(model_dir: pathlib.Path, speculative_config: SpeculativeConfig | None,
                     num_blocks: int = 256, device: str = "cpu", dtype: str = "auto") -> ModelRunner:
    """The runner_harness tiny runner with speculative decoding; a draft model is sharpened like the target."""
    runner = ModelRunner(
        ModelConfig(model=str(model_dir), load_format=LoadFormat.DUMMY, seed=0, dtype=dtype),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks_override=num_blocks),
        SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=256),
        DeviceConfig(device=device), speculative_config,
    )
    sharpen(runner.model)
    draft = draft_model_of(runner)
    if draft is not None:
        sharpen(draft)
    runner.initialize_kv_cache()
    return runner


def draft_model_of(runner: ModelRunner) -> torch.nn.Module | None:
    proposer = runner.spec_decoder.proposer if runner.spec_decoder is not None else None
    return getattr(proposer, "model", None)


class SpecScheduler(ToyScheduler):
    """ToyScheduler that schedules each request's drafts and rolls back rejected ones (module docstring)."""

    def __init__(self, chunk_size: int = 1 << 30, lookahead: int = 0) -> None:
        super().__init__(chunk_size)
        self.lookahead = lookahead
        self.drafts: dict[str, list[int]] = {}
        self.stats = SpecStats()
        self.last_output: ModelRunnerOutput | None = None
        """The runner's output of the latest step."""

    def preempt(self, request_id: str) -> None:
        super().preempt(request_id)
        self.drafts.pop(request_id, None)  # a resumed request starts without drafts

    def schedule(self, only: set[str] | None = None) -> SchedulerOutput:
        new, cached, num_tokens, spec_tokens = [], CachedRequestData(), {}, {}
        for request in self.requests.values():
            if request.done or (only is not None and request.request_id not in only):
                continue
            n = min(request.num_tokens - request.num_computed, self.chunk_size)
            drafts = self.drafts.pop(request.request_id, [])
            if request.num_computed + n == request.num_tokens and drafts:
                room = (request.params.max_tokens or 1 << 30) - len(request.output) - 1
                drafts = drafts[: max(0, room)]
                if drafts:
                    spec_tokens[request.request_id] = drafts
                    n += len(drafts)
            self._place(request, self._allocate(request, n + self.lookahead), new, cached)
            num_tokens[request.request_id] = n
        output = SchedulerOutput(new, cached, num_tokens, sum(num_tokens.values()), finished_req_ids=self.finished,
                                 preempted_req_ids=self.preempted, scheduled_spec_decode_tokens=spec_tokens)
        self.finished, self.preempted = set(), set()
        return output

    def step(self, runner: ModelRunner, only: set[str] | None = None) -> dict[str, list[int]]:
        scheduler_output = self.schedule(only)
        result = self.last_output = runner.execute(scheduler_output)
        for request_id, n in scheduler_output.num_scheduled_tokens.items():
            request, sampled = self.requests[request_id], result.sampled_token_ids[request_id]
            num_drafts = len(scheduler_output.scheduled_spec_decode_tokens.get(request_id, []))
            num_rejected = num_drafts - (len(sampled) - 1) if sampled else 0
            assert 0 <= num_rejected <= num_drafts, (request_id, sampled, num_drafts)
            self.stats.num_drafts += num_drafts
            self.stats.num_accepted += num_drafts - num_rejected
            request.num_computed += n - num_rejected
            request.output.extend(sampled)
            self.drafts[request_id] = list(result.spec_token_ids.get(request_id, []))
            if request.done:
                self.finished.add(request_id)
            else:
                self._check_worker_agrees(runner, request_id)
        return result.sampled_token_ids

    def _check_worker_agrees(self, runner: ModelRunner, request_id: str) -> None:
        request, state = self.requests[request_id], runner.states[request_id]
        assert state.token_ids == request.prompt + request.output, request_id
        # The contract's invariant: a request that has sampled has KV for all its tokens but the last.
        expected = len(state.token_ids) - 1 if request.output else request.num_computed
        assert request.num_computed == expected, (request_id, request.num_computed, len(state.token_ids))
