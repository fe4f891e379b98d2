"""The step loop: the one place where the scheduler meets the model.

One step = `scheduler.schedule()` (ints: which requests, how many tokens, which blocks) →
`runner.execute()` (tensors: forward + sample; skipped when nothing is scheduled) →
`scheduler.update_from_output()` (append tokens, check stops, free blocks, stats). The update runs
every step, even an empty one, because that is where waiting requests time out. Everything here is
synchronous and single-threaded; `AsyncEngine` runs it on its own thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from conveyor.config import EngineConfig
from conveyor.core.outputs import EngineCoreOutput, EngineCoreOutputs, ModelRunnerOutput, SchedulerOutput
from conveyor.core.stats import SchedulerStats
from conveyor.request import FinishReason, Request

EMPTY_RUNNER_OUTPUT = ModelRunnerOutput(sampled_token_ids={})


class Runner(Protocol):
    """What the engine needs from `worker.ModelRunner`."""

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


class SchedulerLike(Protocol):
    """What the engine needs from `core.scheduler.Scheduler` / `StaticScheduler`."""

    def add_request(self, request: Request) -> None: ...

    def schedule(self) -> SchedulerOutput: ...

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> tuple[EngineCoreOutputs, SchedulerStats]: ...

    def finish_requests(self, request_ids: list[str], reason: FinishReason) -> list[EngineCoreOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def check_invariants(self) -> None: ...


@dataclass(frozen=True)
class StepResult:
    """What one engine step produced."""

    outputs: EngineCoreOutputs
    """Per-request news (new tokens, finishes) from this step, batched; iterate for one per request."""
    stats: SchedulerStats
    """The scheduler's state after the step."""


@dataclass(frozen=True)
class ModelLimits:
    """What the loaded model imposes on the engine configuration."""

    num_kv_blocks: int
    """KV blocks allocated by the runner (the scheduler's pool gets the same number)."""
    max_model_len: int
    """Resolved longest request: the configured value capped by the model's max positions."""
    eos_token_ids: tuple[int, ...]
    """The model's end-of-sequence ids (the first one goes on each Request)."""
    vocab_size: int
    """Prompt token ids must be below this."""


class EngineCore:
    """Owns the scheduler and the model runner and advances them one step at a time."""

    def __init__(self, config: EngineConfig, runner: Runner, scheduler: SchedulerLike,
                 limits: ModelLimits) -> None:
        self.config = config
        self.runner = runner
        self.scheduler = scheduler
        self.limits = limits
        self.num_steps = 0

    def add_request(self, request: Request) -> None:
        """Admit a request (raises core.errors.AdmissionError / QueueFullError unchanged)."""
        self.scheduler.add_request(request)

    def abort(self, request_ids: list[str], reason: FinishReason = FinishReason.ABORT) -> list[EngineCoreOutput]:
        """End requests now (client gone, stop string matched); their blocks are freed."""
        if not request_ids:
            return []
        return self.scheduler.finish_requests(request_ids, reason)

    def step(self) -> StepResult:
        scheduler_output = self.scheduler.schedule()
        if _nothing_for_runner(scheduler_output):
            runner_output = EMPTY_RUNNER_OUTPUT
        else:
            runner_output = self.runner.execute(scheduler_output)
        outputs, stats = self.scheduler.update_from_output(scheduler_output, runner_output)
        if self.config.check_invariants:
            self.scheduler.check_invariants()
        self.num_steps += 1
        return StepResult(outputs, stats)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()


def _nothing_for_runner(scheduler_output: SchedulerOutput) -> bool:
    """Skip the runner only when there is nothing to compute and no worker state to drop."""
    return (scheduler_output.is_empty and not scheduler_output.finished_req_ids
            and not scheduler_output.preempted_req_ids)

