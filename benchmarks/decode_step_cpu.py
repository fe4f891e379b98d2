#!/usr/bin/env python3
"""One CPU decode step of the embedded SmolLM2, variant against variant in one process, alternating.

A variant is `QUANTIZATION:ATTENTION` (`none:torch` = float32 weights and the plain-torch paged
attention, i.e. the path before issue 18; `gguf:cpu` = the GGUF blocks and the C paged-decode kernel).
Each variant gets its own ModelRunner and KV cache; B requests with `--context` prompt tokens are
prefilled, then rounds alternate the variants, each timing `--steps` decode steps through
`ModelRunner.execute` (the engine's call: host inputs, forward, LM head, greedy sampling). Alternation
is what makes the comparison hold on a shared machine: a noisy minute hits every variant alike.
Per batch size and variant it prints the median step and the spread of the round medians. With one
thread the clock is this process's CPU time (waiting for a core shared with other jobs does not
count; wall time on the loaded 2-core VM varied 3x between rounds), with more it is wall time.

    PYTHONPATH=src python benchmarks/decode_step_cpu.py --variants none:torch gguf:torch gguf:cpu \\
        --batch-sizes 1 8 --context 800 --num-threads 1
    PYTHONPATH=src python benchmarks/decode_step_cpu.py --variants gguf:cpu --profile   # torch.profiler table

Prints one JSON line per batch size and variant ("RESULT {...}"), times in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from worker_step import HEADROOM_TOKENS, DecodeDriver

from conveyor.config import CacheConfig, DeviceConfig, ModelConfig, Quantization, SchedulerConfig
from conveyor.model.attention import get_attention_backend
from conveyor.worker.model_runner import ModelRunner


def build_runner(variant: str, args: argparse.Namespace) -> ModelRunner:
    quantization, _, attention = variant.partition(":")
    max_batch, max_len = max(args.batch_sizes), args.context + HEADROOM_TOKENS
    runner = ModelRunner(
        ModelConfig(quantization=Quantization(quantization)),
        CacheConfig(num_blocks_override=(max_batch + 1) * (-(-max_len // 16))),
        SchedulerConfig(max_num_seqs=max_batch + 1, max_model_len=max_len,
                        max_num_batched_tokens=max(2048, max_batch * args.context)),
        DeviceConfig(num_threads=args.num_threads),
    )
    runner.initialize_kv_cache()
    if attention:
        runner.model.set_attention_backend(get_attention_backend(attention))
    return runner


def time_steps(driver: DecodeDriver, num_steps: int) -> float:
    """Median milliseconds of `num_steps` decode steps."""
    clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
    times = []
    for _ in range(num_steps):
        start = clock()
        driver.step()
        times.append((clock() - start) * 1e3)
    return statistics.median(times)


def measure(runners: dict[str, ModelRunner], batch_size: int, args: argparse.Namespace) -> None:
    drivers = {}
    for name, runner in runners.items():
        runner.states.clear()
        drivers[name] = DecodeDriver(runner, batch_size, args.context)
        time_steps(drivers[name], 2)  # warm-up
    rounds: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(args.rounds):
        for name, driver in drivers.items():
            rounds[name].append(time_steps(driver, args.steps))
    for name, values in rounds.items():
        print("RESULT " + json.dumps({
            "variant": name, "batch_size": batch_size, "context": args.context, "threads": torch.get_num_threads(),
            "clock": "cpu" if torch.get_num_threads() == 1 else "wall",
            "step_ms": round(statistics.median(values), 2),
            "round_medians_ms": [round(v, 1) for v in values],
        }), flush=True)


def profile(runner: ModelRunner, batch_size: int, args: argparse.Namespace) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    runner.states.clear()
    driver = DecodeDriver(runner, batch_size, args.context)
    time_steps(driver, 2)
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        time_steps(driver, args.steps)
    print(f"batch {batch_size}, context {args.context}, {args.steps} steps")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=["none:torch", "gguf:cpu"],
                        help="QUANTIZATION:ATTENTION pairs (quantization none|gguf, attention torch|cpu)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--context", type=int, default=800)
    parser.add_argument("--steps", type=int, default=5, help="decode steps per variant per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="profile each variant instead of timing")
    args = parser.parse_args()
    runners = {variant: build_runner(variant, args) for variant in args.variants}
    for batch_size in args.batch_sizes:
        if args.profile:
            for runner in runners.values():
                profile(runner, batch_size, args)
        else:
            measure(runners, batch_size, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
