"""CPU time of one scheduler step: `schedule()` + `update_from_output()`, without any model.

Populations: N running decodes (every request one token per step), and a mixed one (decodes plus a
stream of 1024-token prompts chunked into the rest of the budget, requests finishing and arriving).
The worker's part (here the fake runner) is outside the timed region. Times are the thread's CPU
time, median (and minimum) over many steps, which is robust on a shared machine. Interleaved with
every step, the benchmark also times the *contract floor*: building only what the core<->worker
contract forces per request and step (an entry in each of CachedRequestData's three lists, one
dict entry, an entry in each of EngineCoreOutputs' two lists),
so `x floor` compares the scheduler with the least any implementation of the contract pays under the
same load at the same moment.

    PYTHONPATH=src python benchmarks/scheduler_step.py --num-steps 500

Before/after: `--compare BASE_SRC NEW_SRC` runs this benchmark on two source trees (each a `src`
folder, e.g. one exported with `git archive`), alternating them for `--rounds` rounds (the order flips
each round), and prints per population the median of the rounds' medians with their min-max spread:

    PYTHONPATH=src python3 benchmarks/scheduler_step.py --compare /tmp/base/src src --rounds 6 --num-steps 500
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

from conveyor.config import CacheConfig, SchedulerConfig
from conveyor.core.fake_runner import FakeModelRunner
from conveyor.core.outputs import NO_NEW_BLOCKS, CachedRequestData, EngineCoreOutputs
from conveyor.core.scheduler import Scheduler
from conveyor.request import Request
from conveyor.sampling_params import SamplingParams

GOAL_MS = {256: 0.5, 1024: 2.0}
BLOCK_SIZE = 16


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
    """Median CPU time of schedule() + update_from_output()."""
    cpu_min_ms: float
    wall_ms: float
    floor_ms: float
    """Median CPU time of the contract floor for the same number of scheduled requests."""
    tokens_per_step: float


def _request(index: int, prompt_len: int, max_tokens: int) -> Request:
    prompt = [1000 + (index * 7919 + k) % 30000 for k in range(prompt_len)]
    return Request(f"req-{index}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), 0.0)


def _make(population: Population, num_steps: int) -> Scheduler:
    num_seqs = population.num_decodes + (64 if population.mixed else 0)
    max_model_len = max(population.prompt_len * 2, population.long_prompt_len) + num_steps * 2 + 64
    config = SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=population.max_num_batched_tokens,
                             max_model_len=max_model_len)
    return Scheduler(config, CacheConfig(block_size=BLOCK_SIZE), num_seqs * (max_model_len // BLOCK_SIZE + 1))


def _fill(scheduler: Scheduler, runner: FakeModelRunner, population: Population, num_steps: int,
          rng: random.Random) -> int:
    """Admit the decoding population and run until every prompt is prefilled; returns the next id."""
    for index in range(population.num_decodes):  # varied lengths: blocks fill on different steps
        prompt_len = rng.randint(population.prompt_len // 2, population.prompt_len * 3 // 2)
        scheduler.add_request(_request(index, prompt_len, num_steps * 2))
    while scheduler.num_waiting:
        output = scheduler.schedule()
        scheduler.update_from_output(output, runner.execute(output))
    return population.num_decodes


def _contract_floor_ns(request_ids: list[str]) -> int:
    start = time.thread_time_ns()
    cached, scheduled, tokens = CachedRequestData(), {}, [5]
    for request_id in request_ids:
        cached.req_ids.append(request_id)
        cached.new_block_ids.append(NO_NEW_BLOCKS)
        cached.num_computed_tokens.append(100)
        scheduled[request_id] = 1
    outputs = EngineCoreOutputs()
    for request_id in request_ids:
        outputs.req_ids.append(request_id)
        outputs.new_token_ids.append(tokens)
    return time.thread_time_ns() - start


def measure(population: Population, num_steps: int, seed: int) -> Timing:
    rng = random.Random(seed)
    scheduler = _make(population, num_steps)
    runner = FakeModelRunner(BLOCK_SIZE)
    next_id = _fill(scheduler, runner, population, num_steps, rng)
    cpu_ns, wall_ns, floor_ns, tokens = [], [], [], []
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
        floor_ns.append(_contract_floor_ns(list(output.num_scheduled_tokens)))
        while population.mixed and scheduler.num_running + scheduler.num_waiting < population.num_decodes + 2:
            scheduler.add_request(_request(next_id, 16, rng.randint(1, 64)))  # keep the population steady
            next_id += 1
        cpu_ns.append(cpu1 - cpu0 + cpu3 - cpu2)
        wall_ns.append(wall1 - wall0 + wall3 - wall2)
        tokens.append(output.total_num_scheduled_tokens)
    return Timing(statistics.median(cpu_ns) / 1e6, min(cpu_ns) / 1e6, statistics.median(wall_ns) / 1e6,
                  statistics.median(floor_ns) / 1e6, statistics.mean(tokens))


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


def _populations(sizes: list[int]) -> list[Population]:
    populations = [Population(f"{n} decodes", n, 128, max(2048, n)) for n in sizes]
    populations.append(Population("256 decodes + 1024-token prefills", 256, 128, 2048, long_prompt_len=1024))
    return populations


def _goal(population: Population) -> str:
    return "-" if population.mixed else f"{GOAL_MS.get(population.num_decodes, float('nan')):.1f}"


def _run_one(args: argparse.Namespace) -> int:
    populations = _populations(args.sizes)
    if args.json:
        import conveyor  # noqa: PLC0415 -- which source tree this run measures

        rows = {p.name: asdict(measure(p, args.num_steps, args.seed)) for p in populations}
        print(json.dumps({"source": os.path.dirname(conveyor.__file__), "rows": rows}))
        return 0
    print(f"CPU: {_cpu_model()} ({os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}); "
          f"Python {platform.python_version()}; {args.num_steps} steps per row; "
          f"calibration loop {loop_ns_per_iteration():.0f} ns/iteration")
    print(f"{'population':<34} {'tok/step':>8} {'cpu ms':>7} {'min ms':>7} {'wall ms':>8} {'floor ms':>8} "
          f"{'x floor':>7} {'goal ms':>7}")
    for population in populations:
        t = measure(population, args.num_steps, args.seed)
        print(f"{population.name:<34} {t.tokens_per_step:>8.0f} {t.cpu_ms:>7.3f} {t.cpu_min_ms:>7.3f} "
              f"{t.wall_ms:>8.3f} {t.floor_ms:>8.3f} {t.cpu_ms / t.floor_ms:>7.1f} {_goal(population):>7}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    """Alternate the two source trees, flipping the order each round; the spread is across rounds."""
    sources = [os.path.abspath(path) for path in args.compare]
    medians: dict[str, dict[str, list[float]]] = {source: {} for source in sources}
    for round_index in range(args.rounds):
        for source in sources if round_index % 2 == 0 else sources[::-1]:
            command = [sys.executable, os.path.abspath(__file__), "--json", "--num-steps", str(args.num_steps),
                       "--seed", str(args.seed), "--sizes", *map(str, args.sizes)]
            result = subprocess.run(command, env={**os.environ, "PYTHONPATH": source}, check=True,
                                    capture_output=True, text=True)
            run = json.loads(result.stdout)
            if not run["source"].startswith(source):
                raise SystemExit(f"--compare {source}: the run imported conveyor from {run['source']}")
            for name, timing in run["rows"].items():
                medians[source].setdefault(name, []).append(timing["cpu_ms"])
    base, new = sources
    print(f"CPU: {_cpu_model()} ({os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}); Python "
          f"{platform.python_version()}; {args.rounds} rounds x {args.num_steps} steps, alternating\n"
          f"  A = {base}\n  B = {new}\ncpu ms per step (schedule + update): median of the rounds' medians "
          "[min-max]")
    print(f"{'population':<34} {'A':>21} {'B':>21} {'B/A':>5} {'goal ms':>7}")
    for population in _populations(args.sizes):
        a, b = medians[base][population.name], medians[new][population.name]
        print(f"{population.name:<34} {_spread(a):>21} {_spread(b):>21} "
              f"{statistics.median(b) / statistics.median(a):>5.2f} {_goal(population):>7}")
    return 0


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-steps", type=int, default=500, help="timed steps per population")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024], help="running decodes")
    parser.add_argument("--json", action="store_true", help="one JSON line of timings (used by --compare)")
    parser.add_argument("--compare", nargs=2, metavar=("BASE_SRC", "NEW_SRC"),
                        help="alternate two source trees (each the folder holding conveyor/)")
    parser.add_argument("--rounds", type=int, default=6, help="with --compare: runs of each tree")
    args = parser.parse_args(argv)
    return _compare(args) if args.compare else _run_one(args)


if __name__ == "__main__":
    raise SystemExit(main())
