"""CPU time of one scheduler step: `schedule()` + `update_from_output()`, without any model.

Populations: N running decodes (every request one token per step), and a mixed one (decodes plus a
stream of chunked prefills filling the rest of the token budget, requests finishing and arriving).
The worker's part (here the fake runner) is outside the timed region. Times are the median over many
steps of the thread's CPU time (robust on a shared machine), with wall time beside it.

    PYTHONPATH=src python benchmarks/scheduler_step.py --num-steps 400
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from conveyor.config import CacheConfig, SchedulerConfig
from conveyor.core.fake_runner import FakeModelRunner
from conveyor.core.fast_outputs import cached_request_data, token_output
from conveyor.core.scheduler import Scheduler
from conveyor.request import Request
from conveyor.sampling_params import SamplingParams

GOAL_MS = {256: 0.5, 1024: 2.0}


@dataclass(frozen=True)
class Population:
    """One benchmark case."""

    name: str
    """Row label."""
    num_decodes: int
    """Requests kept running and decoding."""
    prompt_len: int
    """Mean prompt tokens of the decoding requests (uniform in [0.5, 1.5] x this)."""
    max_num_batched_tokens: int
    """Token budget per step."""
    long_prompt_len: int = 0
    """If > 0: also stream in prompts this long (chunked into the spare budget) and finish requests
    at random lengths, replacing them, so prefills and decodes mix in every step."""

    @property
    def mixed(self) -> bool:
        return self.long_prompt_len > 0


@dataclass(frozen=True)
class Timing:
    cpu_ms: float
    wall_ms: float
    tokens_per_step: float


def _request(index: int, prompt_len: int, max_tokens: int) -> Request:
    prompt = [1000 + (index * 7919 + k) % 30000 for k in range(prompt_len)]
    return Request(f"req-{index}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), 0.0)


def _make(population: Population, num_steps: int) -> Scheduler:
    num_seqs = population.num_decodes + (64 if population.mixed else 0)
    config = SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=population.max_num_batched_tokens,
                             max_model_len=max(population.prompt_len * 2, population.long_prompt_len)
                             + num_steps * 2 + 64)
    max_len_blocks = config.max_model_len // 16 + 1
    return Scheduler(config, CacheConfig(block_size=16), num_seqs * max_len_blocks)


def measure(population: Population, num_steps: int, seed: int) -> Timing:
    rng = random.Random(seed)
    scheduler = _make(population, num_steps)
    runner = FakeModelRunner(16)
    next_id = 0
    for _ in range(population.num_decodes):  # varied lengths: blocks fill (and get hashed) on different steps
        prompt_len = rng.randint(population.prompt_len // 2, population.prompt_len * 3 // 2)
        scheduler.add_request(_request(next_id, prompt_len, num_steps * 2))
        next_id += 1
    while scheduler.num_waiting:  # warm up: every prompt prefilled, all decoding
        scheduler.update_from_output(output := scheduler.schedule(), runner.execute(output))
    cpu_ns, wall_ns, tokens = [], [], []
    for _ in range(num_steps):
        if population.mixed and scheduler.num_waiting < 2:
            scheduler.add_request(_request(next_id, population.long_prompt_len, rng.randint(1, 64)))
            next_id += 1
        cpu0, wall0 = time.thread_time_ns(), time.perf_counter_ns()
        output = scheduler.schedule()
        cpu1, wall1 = time.thread_time_ns(), time.perf_counter_ns()
        runner_output = runner.execute(output)
        cpu2, wall2 = time.thread_time_ns(), time.perf_counter_ns()
        scheduler.update_from_output(output, runner_output)
        cpu3, wall3 = time.thread_time_ns(), time.perf_counter_ns()
        if population.mixed:  # keep the decode population steady as requests finish
            while scheduler.num_running + scheduler.num_waiting < population.num_decodes + 2:
                scheduler.add_request(_request(next_id, 16, rng.randint(1, 64)))
                next_id += 1
        cpu_ns.append(cpu1 - cpu0 + cpu3 - cpu2)
        wall_ns.append(wall1 - wall0 + wall3 - wall2)
        tokens.append(output.total_num_scheduled_tokens)
    return Timing(statistics.median(cpu_ns) / 1e6, statistics.median(wall_ns) / 1e6, statistics.mean(tokens))


def contract_floor_ms(num_requests: int, num_steps: int) -> float:
    """Median CPU time of only what the core<->worker contract forces per request and step: one
    CachedRequestData, one EngineCoreOutput (both via the fast constructors), one dict entry."""
    request_ids = [f"req-{i}" for i in range(num_requests)]
    samples = []
    for _ in range(num_steps):
        start = time.thread_time_ns()
        cached, scheduled, outputs = [], {}, []
        for request_id in request_ids:
            cached.append(cached_request_data(request_id, [], 100))
            scheduled[request_id] = 1
        for request_id in request_ids:
            outputs.append(token_output(request_id, [5], []))
        samples.append(time.thread_time_ns() - start)
    return statistics.median(samples) / 1e6


def loop_ns_per_iteration() -> float:
    """CPU speed calibration: a trivial Python loop (about 15-20 ns/iteration on an idle modern core)."""
    start, total = time.thread_time_ns(), 0
    for value in range(1_000_000):
        total += value
    return (time.thread_time_ns() - start) / 1e6


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-steps", type=int, default=400, help="timed steps per population")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024], help="running decodes")
    args = parser.parse_args(argv)
    populations = [Population(f"{n} decodes", n, 128, max(2048, n)) for n in args.sizes]
    populations.append(Population("256 decodes + 1024-token prefills", 256, 128, 2048, long_prompt_len=1024))
    print(f"CPU: {_cpu_model()} ({os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}); "
          f"Python {platform.python_version()}; median of {args.num_steps} steps; "
          f"calibration loop {loop_ns_per_iteration():.0f} ns/iteration")
    print(f"{'population':<32} {'tokens/step':>11} {'cpu ms':>8} {'wall ms':>8} {'goal ms':>8}")
    run: Callable[[Population], Timing] = lambda p: measure(p, args.num_steps, args.seed)  # noqa: E731
    for population in populations:
        timing = run(population)
        goal = GOAL_MS.get(population.num_decodes) if not population.mixed else None
        goal_text = f"{goal:.1f}" if goal is not None else "-"
        print(f"{population.name:<32} {timing.tokens_per_step:>11.0f} {timing.cpu_ms:>8.3f} "
              f"{timing.wall_ms:>8.3f} {goal_text:>8}")
    for size in args.sizes:
        floor_ms = contract_floor_ms(size, args.num_steps)
        print(f"{'contract floor, ' + str(size) + ' requests':<32} {'':>11} {floor_ms:>8.3f} {'':>8} {'':>8}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
