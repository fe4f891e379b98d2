"""The step loop: the one place where the scheduler meets the model.

One step = `scheduler.schedule()` (ints: which requests, how many tokens, which blocks) →
`runner.execute()` (tensors: forward + sample; skipped when nothing is scheduled) →
`scheduler.update_from_output()` (append tokens, check stops, free blocks, stats). The update runs
every step, even an empty one, because that is where waiting requests time out. With async scheduling
(`AsyncEngineCore`) the runner's launch of step N+1 comes before step N's update, so the host work
of the one overlaps the device work of the other. Everything here is single-threaded; `AsyncEngine`
runs it on its own thread.

A request with a structured-outputs grammar waits here, outside the scheduler, while the runner builds
its matcher on a compile thread (vLLM's WAITING_FOR_FSM): a grammar that takes seconds to build never
stalls a step. Each step first hands the scheduler those whose matcher is ready; an abort ends a waiting
one at once.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from conveyor.config import EngineConfig
from conveyor.core.errors import AdmissionError, QueueFullError
from conveyor.core.lifecycle import EosTokenIds
from conveyor.core.outputs import EngineCoreOutput, EngineCoreOutputs, ModelRunnerOutput, SchedulerOutput
from conveyor.core.stats import SchedulerStats
from conveyor.core.step_log import StepLog, StepRecord, StepTiming
from conveyor.request import FinishReason, Request

EMPTY_RUNNER_OUTPUT = ModelRunnerOutput(sampled_token_ids={})


class Runner(Protocol):
    """What the engine needs from `worker.ModelRunner`."""

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


class PipelinedRunner(Runner, Protocol):
    """A runner that can start a step and hand its output over later (async scheduling)."""

    def launch(self, scheduler_output: SchedulerOutput) -> Any: ...

    def collect(self, handle: Any) -> ModelRunnerOutput: ...


logger = logging.getLogger(__name__)

GRAMMAR_WAIT_S = 0.05
"""Longest an idle engine blocks on a grammar being built before it steps (and reads its inputs) again."""


class SchedulerLike(Protocol):
    """What the engine needs from `core.scheduler.Scheduler` / `StaticScheduler`."""

    def add_request(self, request: Request) -> None: ...

    def schedule(self) -> SchedulerOutput: ...

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> tuple[EngineCoreOutputs, SchedulerStats]: ...

    def finish_requests(self, request_ids: list[str], reason: FinishReason) -> list[EngineCoreOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool: ...

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
    """The model's end-of-sequence ids (generation_config.json's, else config.json's)."""
    vocab_size: int
    """Prompt token ids must be below this."""
    tokenizer_eos_token_id: int | None = None
    """The tokenizer's EOS (None: it names none, or the core was built without reading it)."""

    @property
    def eos(self) -> EosTokenIds:
        """What requests stop on: the tokenizer's EOS first (vLLM's primary), then the model's."""
        return EosTokenIds.resolve(self.tokenizer_eos_token_id, self.eos_token_ids)


class EngineCore:
    """Owns the scheduler and the model runner and advances them one step at a time."""

    def __init__(self, config: EngineConfig, runner: Runner, scheduler: SchedulerLike,
                 limits: ModelLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.runner = runner
        self.scheduler = scheduler
        self.limits = limits
        self.num_steps = 0
        self._grammars = getattr(runner, "structured_outputs", None)
        """The runner's matchers, when it masks (None: constrained requests go straight to the scheduler)."""
        self._waiting_for_grammar: dict[str, Request] = {}
        self._released_errors: list[EngineCoreOutput] = []
        """Waiting requests the scheduler refused when their grammar was ready: reported by the next step."""
        self.step_log = StepLog(config.step_log_size) if config.step_log_size else None
        """Each step's batch and wall time (--step-log-size; None when off: one branch per step)."""
        self._clock = clock
        """The step log's clock (a test's injected one times steps exactly)."""
        self._step_start_s = 0.0

    def add_request(self, request: Request) -> None:
        """Admit a request (raises core.errors.AdmissionError / QueueFullError unchanged); one with a
        grammar waits for its matcher first."""
        constraint = request.sampling_params.structured_output
        if constraint is None or self._grammars is None:
            self.scheduler.add_request(request)
            return
        if request.request_id in self._waiting_for_grammar:
            raise AdmissionError("request_id", f"{request.request_id!r} is already in use")
        self._grammars.prepare(request.request_id, constraint)
        self._waiting_for_grammar[request.request_id] = request

    def load_grammar_vocabulary(self) -> None:
        """Before serving: the work a first grammar would otherwise do inside a step's time (a server
        calls it; an offline LLM that may never see a grammar does not pay for it)."""
        if self._grammars is not None:
            self._grammars.load_tokenizer()

    def abort(self, request_ids: list[str], reason: FinishReason = FinishReason.ABORT) -> list[EngineCoreOutput]:
        """End requests now (client gone, stop string matched); their blocks are freed."""
        if not request_ids:
            return []
        waiting = [self._waiting_for_grammar.pop(rid) for rid in request_ids if rid in self._waiting_for_grammar]
        if not waiting:
            return self.scheduler.finish_requests(request_ids, reason)
        waiting_ids = {request.request_id for request in waiting}
        if self._grammars is not None:
            self._grammars.drop(waiting_ids)
        rest = [rid for rid in request_ids if rid not in waiting_ids]
        return [_ended(request, reason) for request in waiting] + self.scheduler.finish_requests(rest, reason)

    def _schedule(self) -> SchedulerOutput:
        """The scheduler's next step, after it received the requests whose matcher is now ready."""
        self._step_start_s = self._clock()  # the step log's start; a clock read is noise next to a step
        grammars = self._grammars
        if grammars is not None and self._waiting_for_grammar and not self.scheduler.has_unfinished_requests():
            grammars.wait(next(iter(self._waiting_for_grammar)), GRAMMAR_WAIT_S)  # else only empty steps
        for request_id, request in list(self._waiting_for_grammar.items()):
            if grammars is None or not grammars.is_ready(request_id):
                continue
            del self._waiting_for_grammar[request_id]
            try:
                self.scheduler.add_request(request)
            except (AdmissionError, QueueFullError) as error:  # the front end admitted it: a bug, as in core_proc
                logger.error("request %s refused by the scheduler after its grammar: %s", request_id, error)
                self._released_errors.append(_ended(request, FinishReason.ERROR))
        return self.scheduler.schedule()

    def step(self) -> StepResult:
        scheduler_output = self._schedule()
        if _nothing_for_runner(scheduler_output):
            return self._apply(scheduler_output, EMPTY_RUNNER_OUTPUT)
        return self._apply(scheduler_output, self.runner.execute(scheduler_output))

    def _apply(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput,
               launched: _InFlight | None = None, settle_start_s: float = 0.0) -> StepResult:
        """The scheduler takes the step's output (append, stop, free); invariants checked if asked.
        Requests whose grammar failed end first, as errors: the EOS the worker forced for them this step
        would otherwise finish them as a plain stop. `launched`: an async step, settled from
        `settle_start_s` (its step log time is its launch plus its settle; None: one span)."""
        failed = self._fail_grammars(runner_output.grammar_errors)
        outputs, stats = self.scheduler.update_from_output(scheduler_output, runner_output)
        outputs.finished_outputs.extend(failed)
        outputs.finished_outputs.extend(self._released_errors)
        self._released_errors = []
        if self._waiting_for_grammar:  # waiting for their matcher is waiting (vLLM counts WAITING_FOR_FSM)
            stats = dataclasses.replace(stats, num_waiting_reqs=stats.num_waiting_reqs + len(self._waiting_for_grammar))
        if self.config.check_invariants:
            self.scheduler.check_invariants()
        if self.step_log is not None:
            self.step_log.record(scheduler_output, stats, timing=self._timing(launched, settle_start_s))
        self.num_steps += 1
        return StepResult(outputs, stats)

    def _timing(self, launched: _InFlight | None, settle_start_s: float) -> StepTiming:
        if launched is None:
            return StepTiming(self._step_start_s, self._clock())
        return StepTiming(launched.start_s, self._clock(), launched.launch_time_s, settle_start_s)

    def _fail_grammars(self, errors: dict[str, str | None]) -> list[EngineCoreOutput]:
        """End the requests whose grammar failed; a None message (the engine's fault) is an engine error."""
        if not errors:
            return []
        finished = self.scheduler.finish_requests(list(errors), FinishReason.ERROR)
        return [dataclasses.replace(output, error_message=errors[output.request_id]) for output in finished]

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting_for_grammar or self._released_errors) or self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's: forget the prefix cache; False (nothing changed) while a request holds KV blocks,
        unless `reset_running_requests` preempts them first (they are recomputed, outputs unchanged)."""
        return self.scheduler.reset_prefix_cache(reset_running_requests)

    def drain_step_log(self) -> list[StepRecord] | None:
        """The step records logged since the last drain, oldest first (None: --step-log-size is 0)."""
        return None if self.step_log is None else self.step_log.drain()

    def shutdown(self) -> None:
        """Release what the runner holds outside this process (tensor-parallel ranks); idempotent."""
        close = getattr(self.runner, "shutdown", None)
        if close is not None:
            close()
        if self._grammars is not None:
            self._grammars.shutdown()  # queued builds are dropped; one running finishes on its thread


@dataclass(frozen=True)
class _InFlight:
    """A launched step whose output is not applied yet."""

    scheduler_output: SchedulerOutput
    handle: Any
    start_s: float = 0.0
    """When its schedule began (the step log's)."""
    launch_time_s: float = 0.0
    """Its schedule + prepare + launch: charged to it, not to the step settled after it."""


class AsyncEngineCore(EngineCore):
    """`EngineCore` with one step in flight (vLLM's async scheduling; needs `core.AsyncScheduler`).

    Each `step()` schedules and launches step N+1, then collects step N and applies its output, so the
    host's scheduling and input preparation of N+1 overlap the device's work on N. The first step of
    a burst (nothing in flight) immediately goes on to the next, so every call returns one applied
    step; a step with nothing to launch settles the one in flight instead.
    """

    def __init__(self, config: EngineConfig, runner: PipelinedRunner, scheduler: SchedulerLike,
                 limits: ModelLimits, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(config, runner, scheduler, limits, clock)
        self.runner: PipelinedRunner = runner
        self._in_flight: _InFlight | None = None

    def step(self) -> StepResult:
        """The step log times each step by its own launch plus its settle (core/step_log.py's docstring):
        the launch of N+1, which runs before N is settled, is not N's."""
        scheduler_output = self._schedule()
        start_s = self._step_start_s
        if _nothing_for_runner(scheduler_output):
            previous, self._in_flight = self._in_flight, None
            if previous is None:
                return self._apply(scheduler_output, EMPTY_RUNNER_OUTPUT)
            # this empty schedule is the settled step's time: nothing else is logged for it
            return self._apply(previous.scheduler_output, self.runner.collect(previous.handle), previous, start_s)
        handle = self.runner.launch(scheduler_output)
        launched_s = self._clock() if self.step_log is not None else start_s  # an unlogged step reads it once
        previous, self._in_flight = self._in_flight, _InFlight(scheduler_output, handle, start_s, launched_s - start_s)
        if previous is None:
            return self.step()  # a burst starts: launch the next step before applying this one
        return self._apply(previous.scheduler_output, self.runner.collect(previous.handle), previous, launched_s)

    def has_unfinished_requests(self) -> bool:
        return self._in_flight is not None or super().has_unfinished_requests()


def make_engine_core(config: EngineConfig, runner: Runner, scheduler: SchedulerLike,
                     limits: ModelLimits, clock: Callable[[], float] = time.monotonic) -> EngineCore:
    """The step loop `config.scheduler.async_scheduling` asks for (`clock`: the step log's)."""
    if config.scheduler.async_scheduling:
        return AsyncEngineCore(config, runner, scheduler, limits, clock)  # type: ignore[arg-type]
    return EngineCore(config, runner, scheduler, limits, clock)


def _nothing_for_runner(scheduler_output: SchedulerOutput) -> bool:
    """Skip the runner only when there is nothing to compute and no worker state to drop."""
    return (scheduler_output.is_empty and not scheduler_output.finished_req_ids
            and not scheduler_output.preempted_req_ids)



def _ended(request: Request, reason: FinishReason) -> EngineCoreOutput:
    """The final output of a request that ends before the scheduler ever had it (no tokens, no blocks)."""
    request.timings.finished_s = time.monotonic()
    return EngineCoreOutput(request.request_id, [], finish_reason=reason, timings=request.timings,
                            num_prompt_tokens=request.num_prompt_tokens)
