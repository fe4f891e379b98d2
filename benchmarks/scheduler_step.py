"""CPU time of one scheduler step: `schedule()` + `update_from_output()`, without any model.

Populations: N running decodes (every request one token per step), and a mixed one (decodes plus a
stream of 1024-token prompts chunked into the rest of the budget, requests finishing and arriving).
The worker's part (here the fake runner) is outside the timed region. Times are the thread's CPU
time, median (and minimum) over many steps, which is robust on a shared machine. Interleaved with
every step, the benchmark also times the *contract floor*: building only what the core<->worker
contract forces per request and step (an entry in each of CachedRequestData's three lists, one
dict entry, an entry in each of EngineCoreOutputs' two lists), so `x floor` compares the scheduler
with the least any implementation of the contract pays under the same load at the same moment.

    PYTHONPATH=src python benchmarks/scheduler_step.py --num-steps 500

Before/after: `--compare BASE_SRC` loads a second source tree (a `src` folder, e.g. main exported
with `git archive main src | tar -x -C /tmp/main`) beside the importable one, as a renamed copy in the
same process, builds the same population on both and alternates them step by step (A B, B A, ...),
so both see the same moments of a noisy machine. It prints each side's median step with its p10-p90
and B/A, with the spread of B/A over 8 windows of consecutive steps:

    PYTHONPATH=src python benchmarks/scheduler_step.py --compare /tmp/main/src --num-steps 600
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any

GOAL_MS = {256: 0.5, 1024: 2.0}
BLOCK_SIZE = 16
NUM_WINDOWS = 8


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


class Tree:
    """The conveyor modules of one source tree (`package` is "conveyor" or a renamed copy)."""

    def __init__(self, package: str) -> None:
        def module(name: str) -> ModuleType:
            return importlib.import_module(f"{package}.{name}")

        self.package = package
        self.config, self.outputs = module("config"), module("core.outputs")
        self.scheduler, self.fake_runner = module("core.scheduler"), module("core.fake_runner")
        self.request, self.sampling_params = module("request"), module("sampling_params")


def renamed_copy(src: str, package: str) -> str:
    """Copy SRC/conveyor's Python files into a temporary folder as `package`, their imports of
    conveyor renamed, and put the folder on sys.path (the core imports only the standard library)."""
    root = tempfile.mkdtemp(prefix="scheduler-step-")
    source = os.path.join(src, "conveyor")
    for folder, _, files in os.walk(source):
        target = os.path.join(root, package, os.path.relpath(folder, source))
        os.makedirs(target, exist_ok=True)
        for name in (f for f in files if f.endswith(".py")):
            with open(os.path.join(folder, name)) as text:
                code = re.sub(r"\bconveyor\b(?=[. ])", package, text.read())
            with open(os.path.join(target, name), "w") as out:
                out.write(code)
    sys.path.insert(0, root)
    return root


class Run:
    """One population on one tree: a filled scheduler and its fake runner, stepped on demand."""

    def __init__(self, tree: Tree, population: Population, num_steps: int, seed: int) -> None:
        self.tree, self.population, self.rng = tree, population, random.Random(seed)
        num_seqs = population.num_decodes + (64 if population.mixed else 0)
        max_model_len = max(population.prompt_len * 2, population.long_prompt_len) + num_steps * 2 + 64
        config = tree.config.SchedulerConfig(max_num_seqs=num_seqs, max_model_len=max_model_len,
                                             max_num_batched_tokens=population.max_num_batched_tokens)
        self.scheduler: Any = tree.scheduler.Scheduler(config, tree.config.CacheConfig(block_size=BLOCK_SIZE),
                                                       num_seqs * (max_model_len // BLOCK_SIZE + 1))
        self.runner: Any = tree.fake_runner.FakeModelRunner(BLOCK_SIZE)
        for index in range(population.num_decodes):  # varied lengths: blocks fill on different steps
            prompt_len = self.rng.randint(population.prompt_len // 2, population.prompt_len * 3 // 2)
            self.scheduler.add_request(self._request(index, prompt_len, num_steps * 2))
        self.next_id = population.num_decodes
        while self.scheduler.num_waiting:  # every prompt prefilled before timing starts
            output = self.scheduler.schedule()
            self.scheduler.update_from_output(output, self.runner.execute(output))

    def _request(self, index: int, prompt_len: int, max_tokens: int) -> Any:
        prompt = [1000 + (index * 7919 + k) % 30000 for k in range(prompt_len)]
        params = self.tree.sampling_params.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        return self.tree.request.Request(f"req-{index}", prompt, params, 0.0)

    def _arrive(self, prompt_len: int) -> None:
        self.scheduler.add_request(self._request(self.next_id, prompt_len, self.rng.randint(1, 64)))
        self.next_id += 1

    def step(self) -> tuple[int, int, Any]:
        """One timed step: (CPU ns, wall ns, the SchedulerOutput); the fake runner is not timed."""
        population, scheduler = self.population, self.scheduler
        if population.mixed and scheduler.num_waiting < 2:
            self._arrive(population.long_prompt_len)
        cpu0, wall0 = time.thread_time_ns(), time.perf_counter_ns()
        output = scheduler.schedule()
        cpu1, wall1 = time.thread_time_ns(), time.perf_counter_ns()
        runner_output = self.runner.execute(output)
        cpu2, wall2 = time.thread_time_ns(), time.perf_counter_ns()
        scheduler.update_from_output(output, runner_output)
        cpu3, wall3 = time.thread_time_ns(), time.perf_counter_ns()
        while population.mixed and scheduler.num_running + scheduler.num_waiting < population.num_decodes + 2:
            self._arrive(16)  # keep the population steady
        return cpu1 - cpu0 + cpu3 - cpu2, wall1 - wall0 + wall3 - wall2, output


def _contract_floor_ns(tree: Tree, request_ids: list[str]) -> int:
    start = time.thread_time_ns()
    cached, scheduled, tokens = tree.outputs.CachedRequestData(), {}, [5]
    for request_id in request_ids:
        cached.req_ids.append(request_id)
        cached.new_block_ids.append(tree.outputs.NO_NEW_BLOCKS)
        cached.num_computed_tokens.append(100)
        scheduled[request_id] = 1
    outputs = tree.outputs.EngineCoreOutputs()
    for request_id in request_ids:
        outputs.req_ids.append(request_id)
        outputs.new_token_ids.append(tokens)
    return time.thread_time_ns() - start


def measure(tree: Tree, population: Population, num_steps: int, seed: int) -> Timing:
    run = Run(tree, population, num_steps, seed)
    cpu_ns, wall_ns, floor_ns, tokens = [], [], [], []
    for _ in range(num_steps):
        cpu, wall, output = run.step()
        floor_ns.append(_contract_floor_ns(tree, list(output.num_scheduled_tokens)))
        cpu_ns.append(cpu)
        wall_ns.append(wall)
        tokens.append(output.total_num_scheduled_tokens)
    return Timing(statistics.median(cpu_ns) / 1e6, min(cpu_ns) / 1e6, statistics.median(wall_ns) / 1e6,
                  statistics.median(floor_ns) / 1e6, statistics.mean(tokens))


def compare(base: Tree, new: Tree, population: Population, num_steps: int, seed: int) -> str:
    """Both trees on the same population, stepped alternately (the order flips every step)."""
    runs = {"A": Run(base, population, num_steps, seed), "B": Run(new, population, num_steps, seed)}
    cpu_ns: dict[str, list[int]] = {"A": [], "B": []}
    for index in range(num_steps):
        for side in ("A", "B") if index % 2 == 0 else ("B", "A"):
            cpu_ns[side].append(runs[side].step()[0])
    size = num_steps // NUM_WINDOWS
    windows = sorted(statistics.median(cpu_ns["B"][w * size:(w + 1) * size])
                     / statistics.median(cpu_ns["A"][w * size:(w + 1) * size]) for w in range(NUM_WINDOWS))
    ratio = statistics.median(cpu_ns["B"]) / statistics.median(cpu_ns["A"])
    return (f"{population.name:<34} {_spread(cpu_ns['A']):>23} {_spread(cpu_ns['B']):>23} {ratio:>5.2f} "
            f"{windows[0]:.2f}-{windows[-1]:.2f} {_goal(population):>7}")


def _spread(values: list[int]) -> str:
    ordered = sorted(values)
    p10, p90 = ordered[len(ordered) // 10], ordered[len(ordered) * 9 // 10]
    return f"{statistics.median(ordered) / 1e6:.3f} [{p10 / 1e6:.3f}-{p90 / 1e6:.3f}]"


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-steps", type=int, default=500, help="timed steps per population")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024], help="running decodes")
    parser.add_argument("--compare", metavar="BASE_SRC", help="alternate with this source tree (A) step by step")
    args = parser.parse_args(argv)
    new = Tree("conveyor")
    print(f"CPU: {_cpu_model()} ({os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}); "
          f"Python {platform.python_version()}; {args.num_steps} steps per row; "
          f"calibration loop {loop_ns_per_iteration():.0f} ns/iteration")
    if args.compare:
        root = renamed_copy(args.compare, "conveyor_base")
        try:
            base = Tree("conveyor_base")
            print(f"A = {args.compare}\nB = {os.path.dirname(new.config.__file__)}\ncpu ms per step "
                  f"(schedule + update), median [p10-p90]; B/A of the medians, and its range over "
                  f"{NUM_WINDOWS} windows")
            print(f"{'population':<34} {'A':>23} {'B':>23} {'B/A':>5} {'windows':>9} {'goal ms':>7}")
            for population in _populations(args.sizes):
                print(compare(base, new, population, args.num_steps, args.seed), flush=True)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return 0
    print(f"{'population':<34} {'tok/step':>8} {'cpu ms':>7} {'min ms':>7} {'wall ms':>8} {'floor ms':>8} "
          f"{'x floor':>7} {'goal ms':>7}")
    for population in _populations(args.sizes):
        t = measure(new, population, args.num_steps, args.seed)
        print(f"{population.name:<34} {t.tokens_per_step:>8.0f} {t.cpu_ms:>7.3f} {t.cpu_min_ms:>7.3f} "
              f"{t.wall_ms:>8.3f} {t.floor_ms:>8.3f} {t.cpu_ms / t.floor_ms:>7.1f} {_goal(population):>7}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
