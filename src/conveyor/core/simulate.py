"""Step-level simulation: the real scheduler, a fake runner, and a model of step time on a virtual clock.

Model: requests arrive as a seeded Poisson process; each is short or long (prompt and output lengths
per class), generates exactly its output length (ignore_eos), and never hits EOS. One engine step takes
`step_time_base_s + step_time_per_token_s * tokens_in_step` seconds of virtual time (a fixed cost for
reading the weights plus a cost per computed token, the first-order shape of a GPU step), or, with a
calibration fitted to the engine's step log (`conveyor bench calibrate`, core/step_time.py), a cost per
step, per sequence, per prefill and decode token and per context token attended. The clock is
read by the scheduler for its timestamps, so TTFT, E2E and queue time come out exactly as the engine
would report them. Running the same arrivals under continuous and static batching shows the central
claim with numbers: refilling the batch every step beats waiting for a fixed batch's longest member.
The same function answers what-if questions (rate, mix, budget, pool size) before touching a GPU.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

from conveyor.config import Batching, CacheConfig, SchedulerConfig
from conveyor.core.fake_runner import FakeModelRunner
from conveyor.core.policies import make_scheduler
from conveyor.core.scheduler import Scheduler
from conveyor.core.step_log import StepRecord, step_record
from conveyor.core.step_time import CalibratedStepTime
from conveyor.request import Request, RequestTimings
from conveyor.sampling_params import SamplingParams


@dataclass(frozen=True)
class WorkloadConfig:
    """The arrivals: a seeded Poisson process of short and long requests."""

    num_requests: int = 400
    """Requests in the run."""
    request_rate: float = 6.0
    """Mean arrivals per second (Poisson)."""
    long_fraction: float = 0.1
    """Share of requests that are long."""
    short_prompt_tokens: int = 128
    """Prompt length of a short request."""
    short_output_tokens: int = 64
    """Output length of a short request."""
    long_prompt_tokens: int = 1024
    """Prompt length of a long request."""
    long_output_tokens: int = 512
    """Output length of a long request."""
    seed: int = 0
    """Seed of arrival times and classes."""

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1 (got {self.num_requests})")
        if self.request_rate <= 0:
            raise ValueError(f"request_rate must be > 0 (got {self.request_rate})")
        if not 0.0 <= self.long_fraction <= 1.0:
            raise ValueError(f"long_fraction must be in [0, 1] (got {self.long_fraction})")
        lengths = (self.short_prompt_tokens, self.short_output_tokens, self.long_prompt_tokens,
                   self.long_output_tokens)
        if min(lengths) < 1:
            raise ValueError("prompt and output token counts must be >= 1")


@dataclass(frozen=True)
class StepTimeModel:
    """Virtual seconds per engine step = step_time_base_s + step_time_per_token_s * tokens."""

    step_time_base_s: float = 0.015
    """Fixed cost of a step (weights read once per step)."""
    step_time_per_token_s: float = 0.00005
    """Cost of each token computed in the step."""

    def __post_init__(self) -> None:
        if self.step_time_base_s <= 0 or self.step_time_per_token_s < 0:
            raise ValueError("step_time_base_s must be > 0 and step_time_per_token_s >= 0")

    def step_time_s(self, num_tokens: int) -> float:
        return self.step_time_base_s + self.step_time_per_token_s * num_tokens

    def batch_time_s(self, record: StepRecord) -> float:
        return self.step_time_s(record.num_tokens)

    def describe(self) -> str:
        return f"{self.step_time_base_s * 1e3:g} ms + {self.step_time_per_token_s * 1e6:g} us/token"


@dataclass(frozen=True)
class SimulationConfig:
    """One simulated run."""

    scheduler: SchedulerConfig = field(
        default_factory=lambda: SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=2048))
    """Batching policy and limits (`batching` picks continuous or static)."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    """Block size and prefix caching."""
    num_blocks: int = 4096
    """KV blocks in the pool."""
    workload: WorkloadConfig = WorkloadConfig()
    """The arrivals."""
    step_time: StepTimeModel | CalibratedStepTime = StepTimeModel()
    """Seconds per step: the two-parameter model, or one fitted to the engine's step log (core/step_time.py)."""
    max_steps: int = 1_000_000
    """Safety bound on engine steps."""


@dataclass(frozen=True)
class SimulationResult:
    """What a run achieved, in the engine's own latency definitions."""

    batching: Batching
    num_completed: int
    duration_s: float
    """First arrival to last completion (virtual seconds)."""
    completed_per_s: float
    output_tokens_per_s: float
    ttft_p50_s: float
    ttft_p95_s: float
    e2e_p50_s: float
    e2e_p95_s: float
    queue_p50_s: float
    queue_p95_s: float
    num_preemptions: int
    num_steps: int
    mean_tokens_per_step: float


@dataclass
class VirtualClock:
    """The time the scheduler reads: advanced by the simulation, never by the wall."""

    now_s: float = 0.0

    def __call__(self) -> float:
        return self.now_s


@dataclass
class _Trace:
    arrivals: list[tuple[float, Request]]
    finished: list[RequestTimings] = field(default_factory=list)
    num_output_tokens: int = 0
    num_preemptions: int = 0


def make_arrivals(workload: WorkloadConfig) -> list[tuple[float, Request]]:
    """(arrival time, request) in time order; prompts are distinct, so no prefix-cache hits."""
    rng = random.Random(workload.seed)
    now_s = 0.0
    arrivals = []
    for index in range(workload.num_requests):
        now_s += rng.expovariate(workload.request_rate)
        is_long = rng.random() < workload.long_fraction
        prompt_len = workload.long_prompt_tokens if is_long else workload.short_prompt_tokens
        output_len = workload.long_output_tokens if is_long else workload.short_output_tokens
        prompt = [1000 + (index * 131 + k) % 30000 for k in range(prompt_len)]
        params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
        arrivals.append((now_s, Request(f"sim-{index}", prompt, params, arrival_s=now_s)))
    return arrivals


def simulate(config: SimulationConfig) -> SimulationResult:
    """Run every arrival to completion under `config.scheduler.batching`."""
    clock = VirtualClock()
    scheduler = make_scheduler(config.scheduler, config.cache, config.num_blocks, clock)
    runner = FakeModelRunner(config.cache.block_size)
    trace = _Trace(make_arrivals(config.workload))
    next_arrival, num_steps, num_tokens = 0, 0, 0
    while next_arrival < len(trace.arrivals) or scheduler.has_unfinished_requests():
        if not scheduler.has_unfinished_requests():
            clock.now_s = max(clock.now_s, trace.arrivals[next_arrival][0])
        while next_arrival < len(trace.arrivals) and trace.arrivals[next_arrival][0] <= clock.now_s:
            scheduler.add_request(trace.arrivals[next_arrival][1])
            next_arrival += 1
        num_tokens += _step(scheduler, runner, clock, config.step_time, trace)
        num_steps += 1
        if num_steps > config.max_steps:
            raise RuntimeError(f"simulation did not finish within max_steps={config.max_steps}")
    return _summarize(config.scheduler.batching, trace, num_steps, num_tokens)


def _step(scheduler: Scheduler, runner: FakeModelRunner, clock: VirtualClock,
          model: StepTimeModel | CalibratedStepTime, trace: _Trace) -> int:
    output = scheduler.schedule()
    runner_output = runner.execute(output)
    if not output.is_empty:
        clock.now_s += model.batch_time_s(step_record(output))
    outputs, stats = scheduler.update_from_output(output, runner_output)
    trace.num_preemptions += stats.num_preemptions
    trace.num_output_tokens += stats.num_generation_tokens
    trace.finished.extend(out.timings for out in outputs if out.finished and out.timings is not None)
    return output.total_num_scheduled_tokens


def _summarize(batching: Batching, trace: _Trace, num_steps: int, num_tokens: int) -> SimulationResult:
    timings = trace.finished
    first_arrival_s = trace.arrivals[0][0]
    duration_s = max(t.finished_s or 0.0 for t in timings) - first_arrival_s
    ttft = [t.first_token_s - t.arrival_s for t in timings if t.first_token_s is not None]
    e2e = [t.finished_s - t.arrival_s for t in timings if t.finished_s is not None]
    queue = [t.first_scheduled_s - t.arrival_s for t in timings if t.first_scheduled_s is not None]
    return SimulationResult(
        batching=batching, num_completed=len(timings), duration_s=duration_s,
        completed_per_s=len(timings) / duration_s, output_tokens_per_s=trace.num_output_tokens / duration_s,
        ttft_p50_s=percentile(ttft, 50), ttft_p95_s=percentile(ttft, 95),
        e2e_p50_s=percentile(e2e, 50), e2e_p95_s=percentile(e2e, 95),
        queue_p50_s=percentile(queue, 50), queue_p95_s=percentile(queue, 95),
        num_preemptions=trace.num_preemptions, num_steps=num_steps,
        mean_tokens_per_step=num_tokens / max(num_steps, 1))


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def compare(config: SimulationConfig) -> list[SimulationResult]:
    """The same arrivals under continuous and static batching."""
    return [simulate(replace(config, scheduler=replace(config.scheduler, batching=batching)))
            for batching in (Batching.CONTINUOUS, Batching.STATIC)]


def format_table(results: list[SimulationResult]) -> str:
    header = (f"{'batching':<11} {'done':>5} {'req/s':>7} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p95':>9} "
              f"{'E2E p50':>8} {'E2E p95':>8} {'queue p95':>9} {'preempt':>7} {'tok/step':>8}")
    rows = [header]
    for r in results:
        rows.append(f"{r.batching.value:<11} {r.num_completed:>5} {r.completed_per_s:>7.2f} "
                    f"{r.output_tokens_per_s:>8.0f} {r.ttft_p50_s:>8.2f}s {r.ttft_p95_s:>8.2f}s "
                    f"{r.e2e_p50_s:>7.2f}s {r.e2e_p95_s:>7.2f}s {r.queue_p95_s:>8.2f}s {r.num_preemptions:>7} "
                    f"{r.mean_tokens_per_step:>8.0f}")
    return "\n".join(rows)
