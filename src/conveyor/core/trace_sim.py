"""A trace replayed through the real scheduler on a virtual clock: the engine's half of `simulate --trace`.

The workload is `SimRequest`s (token ids, output length, due time, cancellation, session turn) built by the
caller (core may not import bench's traces). Each request enters the real `Scheduler`, so its KV blocks come
from the real block pool and prefix cache, and a dry pool preempts as on the server. Each step advances the
clock by the step-time model's price of its batch (drawn from a calibration's spread, seeded, when asked).
With async scheduling the replay runs AsyncEngineCore's pipeline: the next step is scheduled as the one in
flight starts, so a request due during a step waits for the step after next, and what an ending request
frees goes to the step after next. A request streams one chunk per step that gave it tokens, as the server
sends one SSE chunk per step. A calibration's front end (bench/measure/front_end.py) delays each request's
way in to the scheduler (drawn) and each chunk's way out to the client, so TTFT is the client's.

What the client does is played here too: a request cancelled after S seconds or N chunks is aborted at the
first step boundary past that point (as the server notices a closed stream); a session turn is due when the
previous turn ended plus its think time, with the previous prompt, that turn's tokens, then its own input.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import random
from dataclasses import dataclass, field

from conveyor.config import CacheConfig, SchedulerConfig
from conveyor.core.errors import AdmissionError, QueueFullError
from conveyor.core.fake_runner import FakeModelRunner
from conveyor.core.outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    ModelRunnerOutput,
    SchedulerOutput,
)
from conveyor.core.policies import make_scheduler
from conveyor.core.scheduler import Scheduler
from conveyor.core.simulate import StepTimeModel, VirtualClock
from conveyor.core.step_log import StepRecord, step_record
from conveyor.core.step_time import CalibratedStepTime
from conveyor.request import FinishReason, Request
from conveyor.sampling_params import SamplingParams

COMPLETED, CANCELLED, FAILED = "completed", "cancelled", "failed"
"""A request's outcome, spelled as bench's RequestStatus values."""


_ERRORS = {FinishReason.QUEUE_TIMEOUT: "http_503", FinishReason.ABORT: "http_5xx", FinishReason.ERROR: "http_5xx"}
"""A finish other than a stop or a length is a failure, with the error kind the client would record."""


@dataclass(frozen=True)
class SimRequest:
    """One request of the replayed trace, in tokens."""

    request_id: str
    request_class: str
    input_token_ids: tuple[int, ...]
    """Its prompt; for a session turn after the first, only the turn's new input."""
    output_len: int
    """Tokens it generates (the trace's output_len; the fake runner never emits an EOS)."""
    due_s: float | None
    """When it is sent, from the run start; None for a session turn after the first."""
    cancel_after_s: float | None = None
    """The client closes the stream this long after sending."""
    cancel_after_tokens: int | None = None
    """The client closes the stream after this many chunks."""
    session_id: str | None = None
    turn: int | None = None
    think_time_s: float = 0.0
    """A later turn is due this long after the previous one ended."""


@dataclass(frozen=True)
class SimOutcome:
    """What the client would have recorded for one request (times from the run start)."""

    request: SimRequest
    scheduled_s: float
    """When it was due."""
    sent_s: float
    """When it was sent: when due, or when a slot freed under a concurrency cap (the client is never late)."""
    status: str
    """completed | cancelled | failed."""
    prompt_tokens: int
    output_tokens: int
    chunk_times_s: tuple[float, ...]
    """When each streamed chunk arrived (one per step that gave the request tokens)."""
    end_s: float
    cached_tokens: int = 0
    num_preemptions: int = 0
    queue_s: float | None = None
    """Due to first scheduled (None: never scheduled), as the server's queue-time histogram observes it."""
    error: str | None = None
    """Why it failed: `http_4xx` (can never fit), `http_503` (queue full or timed out), as bench's ErrorKind."""


@dataclass(frozen=True)
class EngineSample:
    """The server's gauges at one moment, as `bench run` scrapes them."""

    t_s: float
    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage_perc: float


@dataclass(frozen=True)
class TraceSimResult:
    """Every request's outcome, the gauges over time and the engine's counters."""

    outcomes: tuple[SimOutcome, ...]
    samples: tuple[EngineSample, ...]
    num_steps: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prompt_tokens: int
    """Prompt tokens computed (recomputation after preemption included), as vllm:prompt_tokens_total."""
    generation_tokens: int


@dataclass(frozen=True)
class TraceSimConfig:
    """The engine the trace is replayed on."""

    scheduler: SchedulerConfig
    cache: CacheConfig
    num_blocks: int
    step_time: StepTimeModel | CalibratedStepTime
    max_concurrency: int | None = None
    """The client's in-flight cap (bench run's --max-concurrency; None: open loop)."""
    sample_interval_s: float = 1.0
    """Gauges are sampled at most this often (bench run's --scrape-interval-s)."""
    max_steps: int = 10_000_000
    """Safety bound on engine steps."""
    seed: int = 0
    """Seeds the draws of step times from a calibration's spread (one seed, one replay)."""


@dataclass
class _InFlight:
    request: SimRequest
    due_s: float
    prompt: list[int]
    sent_s: float = 0.0
    chunk_times_s: list[float] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class _Launched:
    """A step scheduled and computed, its output not yet applied (with async scheduling, the step in flight)."""

    output: SchedulerOutput
    runner_output: ModelRunnerOutput
    time_s: float
    """Its price; 0 for a step that computes nothing (it only hands the worker finished or preempted ids)."""


@dataclass
class _Run:
    """The mutable state of one replay."""

    config: TraceSimConfig
    scheduler: Scheduler
    clock: VirtualClock
    due: list[tuple[float, int, SimRequest, list[int], float]]
    """Heap of (when it reaches the scheduler, tie-break, request, history prefix, due time) not yet sent."""
    later_turns: dict[tuple[str, int], SimRequest]
    in_flight: dict[str, _InFlight] = field(default_factory=dict)
    blocked: collections.deque[_InFlight] = field(default_factory=collections.deque)
    """Due, waiting for a slot under the concurrency cap (first due, first sent)."""
    outcomes: list[SimOutcome] = field(default_factory=list)
    samples: list[EngineSample] = field(default_factory=list)
    free_slots: int = 0
    """Slots the cap left free after the last sends (set by _send_due)."""
    last_free_s: float = 0.0
    """When the latest request ended: a slot it frees is taken then (the client sends at once)."""
    launched: _Launched | None = None
    """With async scheduling, the step in flight: launched, its output applied one engine step later."""
    order: itertools.count[int] = field(default_factory=itertools.count)
    """Tie-break of equal due times: the order they became due in (requests do not compare)."""
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("steps", "preemptions", "queries", "hits", "prompt", "generation"), 0))
    rng: random.Random = field(default_factory=random.Random)
    """Draws each step's quantile of the calibration's spread (seeded from the config)."""
    front_rng: random.Random = field(default_factory=random.Random)
    """Draws each request's way in through the front end (apart, so step draws do not move with it)."""


def simulate_trace(requests: list[SimRequest], config: TraceSimConfig) -> TraceSimResult:
    """Replay `requests` to their ends; outcomes in the order the requests ended."""
    clock = VirtualClock()
    scheduler = make_scheduler(config.scheduler, config.cache, config.num_blocks, clock)
    runner = FakeModelRunner(config.cache.block_size)
    run = _Run(config, scheduler, clock, [], {
        (r.session_id, r.turn): r for r in requests if r.due_s is None and r.session_id and r.turn},
        rng=random.Random(config.seed), front_rng=random.Random(f"front-end-{config.seed}"))
    for request in requests:
        if request.due_s is not None:
            _push_due(run, request.due_s, request, [])
    run.free_slots = config.max_concurrency or 0
    while run.due or run.blocked or run.launched or scheduler.has_unfinished_requests():
        if not scheduler.has_unfinished_requests() and not run.blocked and run.launched is None:
            clock.now_s = max(clock.now_s, run.due[0][0])
        _send_due(run)
        _cancel_late(run)
        if config.scheduler.async_scheduling and (run.launched or scheduler.has_unfinished_requests()):
            _pipelined_step(run, runner)
        elif scheduler.has_unfinished_requests():
            _step(run, runner)
        if run.counts["steps"] > config.max_steps:
            raise RuntimeError(f"the replay did not finish within max_steps={config.max_steps}")
    c = run.counts
    return TraceSimResult(tuple(run.outcomes), tuple(run.samples), c["steps"], c["preemptions"], c["queries"],
                          c["hits"], c["prompt"], c["generation"])


def _send_due(run: _Run) -> None:
    """What is due joins the slot queue; the queue is sent while the cap allows (all of it, open loop).
    A request due during a step is sent at its due time: the server receives it then, and it waits for
    the next schedule at a step boundary as it would there (with async scheduling, for the step after next)."""
    while run.due and run.due[0][0] <= run.clock.now_s:
        _, _, request, history, due_s = heapq.heappop(run.due)
        run.blocked.append(_InFlight(request, due_s, history + list(request.input_token_ids)))
    cap = run.config.max_concurrency
    # Slots only free up between boundaries, so those free after the last sends were free all along: the
    # first requests due since take them at their due time, the rest when a request ended.
    free = run.free_slots
    while run.blocked and (cap is None or len(run.in_flight) < cap):
        flight = run.blocked.popleft()
        flight.sent_s = flight.due_s if cap is None or free > 0 else max(flight.due_s, run.last_free_s)
        free -= 1
        _send(run, flight)
    run.free_slots = 0 if cap is None else cap - len(run.in_flight)


def _send(run: _Run, flight: _InFlight) -> None:
    request = flight.request
    params = SamplingParams(max_tokens=request.output_len, ignore_eos=True, temperature=0.0)
    try:
        run.scheduler.add_request(Request(request.request_id, list(flight.prompt), params, arrival_s=flight.sent_s))
    except (AdmissionError, QueueFullError) as error:
        kind = "http_4xx" if isinstance(error, AdmissionError) else "http_503"
        _end(run, flight, FAILED, flight.sent_s, error=kind)
        return
    run.in_flight[request.request_id] = flight


def _cancel_late(run: _Run) -> None:
    """Time-based cancellations whose moment has passed: aborted before the next step."""
    now_s = run.clock.now_s
    late = [(f, closed_s) for f in run.in_flight.values() if (closed_s := _closed_at(f)) is not None
            and closed_s <= now_s]
    for flight, closed_s in late:
        _abort(run, flight, closed_s)


def _abort(run: _Run, flight: _InFlight, end_s: float) -> None:
    (output,) = run.scheduler.finish_requests([flight.request.request_id], FinishReason.ABORT)
    _end(run, flight, CANCELLED, end_s, output)


def _step(run: _Run, runner: FakeModelRunner) -> None:
    """One synchronous engine step: schedule, compute, apply."""
    step = _launch(run, runner, run.scheduler.schedule())
    if step.output.is_empty:  # nothing could run (a static batch filling up): time passes to the next event
        run.clock.now_s = max(run.clock.now_s, _next_event_s(run))
    run.clock.now_s += step.time_s
    _apply(run, step)


def _pipelined_step(run: _Run, runner: FakeModelRunner) -> None:
    """One `AsyncEngineCore.step` on the virtual clock: the step after the launched one is scheduled as the
    launched one starts on the device, before the launched one's output is applied, so what that output
    frees (a finished request's blocks) reaches the step after next, as on the engine (an idle engine
    launches the first step of a burst, then at once schedules the next)."""
    scheduler, clock = run.scheduler, run.clock
    if run.launched is None:
        output = scheduler.schedule()
        if _nothing_to_launch(output):  # nothing can run yet: time passes to the next event
            clock.now_s = max(clock.now_s, _next_event_s(run))
            _apply(run, _Launched(output, ModelRunnerOutput(sampled_token_ids={}), 0.0))
            return
        run.launched = _launch(run, runner, output)
    output = scheduler.schedule()
    following = None if _nothing_to_launch(output) else _launch(run, runner, output)
    clock.now_s += run.launched.time_s
    previous, run.launched = run.launched, following
    _apply(run, previous)


def _nothing_to_launch(output: SchedulerOutput) -> bool:
    """engine_core._nothing_for_runner: no tokens and no worker state to drop (an empty step is not launched)."""
    return output.is_empty and not output.finished_req_ids and not output.preempted_req_ids


def _launch(run: _Run, runner: FakeModelRunner, output: SchedulerOutput) -> _Launched:
    """The step computed (the fake runner's tokens need no earlier output) and priced; the clock is not moved."""
    runner_output = runner.execute(output)
    return _Launched(output, runner_output, 0.0 if output.is_empty else _step_time_s(run, step_record(output)))


def _apply(run: _Run, step: _Launched) -> None:
    """The step's output applied at the clock's time (its end): tokens streamed, finished requests freed."""
    scheduler, clock = run.scheduler, run.clock
    outputs, stats = scheduler.update_from_output(step.output, step.runner_output)
    c = run.counts
    c["steps"] += 1
    c["preemptions"] += stats.num_preemptions
    c["queries"] += stats.prefix_cache_queries
    c["hits"] += stats.prefix_cache_hits
    c["prompt"] += stats.num_prompt_tokens
    c["generation"] += stats.num_generation_tokens
    _collect(run, outputs)
    if not run.samples or clock.now_s - run.samples[-1].t_s >= run.config.sample_interval_s:
        run.samples.append(EngineSample(clock.now_s, scheduler.num_running, scheduler.num_waiting,
                                        scheduler.kv_cache_usage))


def _step_time_s(run: _Run, record: StepRecord) -> float:
    """The step's time: drawn from the calibration's spread when it has one, else the model's price."""
    model = run.config.step_time
    if isinstance(model, CalibratedStepTime) and model.spread:
        return model.drawn_time_s(record, run.rng.random())
    return model.batch_time_s(record)


def _next_event_s(run: _Run) -> float:
    """The next moment something outside the scheduler happens; RuntimeError when nothing ever will (an
    empty step with nothing to wait for would repeat forever)."""
    moments = [run.due[0][0]] if run.due else []
    moments += [closed_s for f in run.in_flight.values() if (closed_s := _closed_at(f)) is not None]
    if not moments:
        raise RuntimeError("the scheduler scheduled nothing and nothing is due: the replay cannot progress")
    return min(moments)


def _collect(run: _Run, outputs: EngineCoreOutputs) -> None:
    """Record the step's chunks, end what finished, and close the streams that reached their chunk limit."""
    now_s = run.clock.now_s
    model = run.config.step_time  # a calibration's front end delays each chunk on its way out
    seen_s = now_s + (model.front_end_out_s if isinstance(model, CalibratedStepTime) else 0.0)
    for request_id, token_ids in zip(outputs.req_ids, outputs.new_token_ids):
        _chunk(run.in_flight[request_id], token_ids, now_s, seen_s)
    for finished in outputs.finished_outputs:
        flight = run.in_flight[finished.request_id]
        _chunk(flight, finished.new_token_ids, now_s, seen_s)
        error = _ERRORS.get(finished.finish_reason) if finished.finish_reason else None
        closed_s = _closed_at(flight)
        if closed_s is not None and closed_s <= now_s:  # the client gave up before the last chunk came
            _end(run, flight, CANCELLED, closed_s, finished)
        else:
            _end(run, flight, FAILED if error else COMPLETED, seen_s, finished, error)
    for request_id in outputs.req_ids:
        flight = run.in_flight[request_id]
        limit = flight.request.cancel_after_tokens
        if limit is not None and len(flight.chunk_times_s) >= limit:
            _abort(run, flight, now_s)


def _closed_at(flight: _InFlight) -> float | None:
    """When the client closes the stream by its timer (None: it waits for the end)."""
    cancel_s = flight.request.cancel_after_s
    return None if cancel_s is None else flight.sent_s + cancel_s


def _chunk(flight: _InFlight, token_ids: list[int], now_s: float, seen_s: float) -> None:
    """A chunk the client reads at `seen_s`, unless it closed the stream during the step (it is aborted next)."""
    closed_s = _closed_at(flight)
    if token_ids and (closed_s is None or now_s < closed_s):
        flight.chunk_times_s.append(seen_s)
        flight.output_token_ids.extend(token_ids)


def _end(run: _Run, flight: _InFlight, status: str, end_s: float, final: EngineCoreOutput | None = None,
         error: str | None = None) -> None:
    """Record the outcome and make the session's next turn due (after any outcome, as the client does)."""
    request = flight.request
    run.in_flight.pop(request.request_id, None)
    run.last_free_s = max(run.last_free_s, end_s)
    scheduled_s = final.timings.first_scheduled_s if final is not None and final.timings is not None else None
    run.outcomes.append(SimOutcome(
        request, flight.due_s, flight.sent_s, status, len(flight.prompt), len(flight.output_token_ids), tuple(flight.chunk_times_s),
        end_s, final.num_cached_tokens if final else 0, final.num_preemptions if final else 0,
        None if scheduled_s is None else scheduled_s - flight.sent_s, error))
    if request.session_id is None or request.turn is None:
        return
    following = run.later_turns.pop((request.session_id, request.turn + 1), None)
    if following is not None:
        history = flight.prompt + flight.output_token_ids
        due_s = end_s + following.think_time_s  # may be before now (a cancel by timer): sent then, as the client
        _push_due(run, due_s, following, history)


def _push_due(run: _Run, due_s: float, request: SimRequest, history: list[int]) -> None:
    """The request is sent at `due_s` and reaches the scheduler after its way in through the front end."""
    model = run.config.step_time
    delay_s = model.in_delay_s(run.front_rng.random()) if isinstance(model, CalibratedStepTime) else 0.0
    heapq.heappush(run.due, (due_s + delay_s, next(run.order), request, history, due_s))
