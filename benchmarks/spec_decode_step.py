#!/usr/bin/env python3
"""Decode-step cost of speculative decoding in the model runner: off vs a --speculative-config, A/B.

Two runners over the same model (one with speculation, one without) each get B requests, prefilled
once, then decode step after step as the scheduler's half of issue 14 will drive them: a request is
scheduled 1 + len(drafts) tokens with the drafts of its last output, and num_computed_tokens
advances by the accepted count + 1 (core/outputs.py's contract). The two alternate, --steps steps
at a time, --repeats times, in alternating order (A B, B A, ...), so that machine noise hits both alike. Reported per runner: median /
min / max ms per step (each repeat's median), output tokens per step, tokens per second, and the
acceptance rate. The default workload is nano256's (benchmarks/gpu/offline.py: random.seed(0),
prompt lengths randint(100, 1024), ids randint(0, 10000), temperature 0.6): random ids, so n-gram
lookup finds next to nothing and the numbers are its pure overhead.

    PYTHONPATH=src python benchmarks/spec_decode_step.py --device cuda --model benchmarks/models/qwen3-0.6b \\
        --load-format dummy --batch-size 256 --speculative-config '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'
    PYTHONPATH=src python benchmarks/spec_decode_step.py --batch-size 4 --max-prompt 200 --steps 4 --repeats 2   # CPU smoke

With --also-full-verification a third runner, "spec-full", sends even its draft-less steps through
the verification path (SpecDecoder.verify_step) instead of the plain step: the A/B of that fast path.

With --phases each runner's step is split into phases (spec_phases.py: the driver's stand-in for the
scheduler, input preparation, forward, LM head, sampler, proposer, the runner's own bookkeeping),
exclusive CPU ms per step, one more JSON line per runner ("PHASES {...}"). The CPU attribution of
issue 14 runs a tiny model, so that the host path dominates (one torch thread: CPU time is host work):

    PYTHONPATH=src python benchmarks/spec_decode_step.py --model benchmarks/models/qwen3-tiny \
        --load-format dummy --batch-size 256 --max-prompt 600 --num-threads 1 --phases --steps 30 --repeats 9

Prints one JSON line per runner ("RESULT {...}").
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
from spec_phases import PhaseClock, instrument_modules, instrument_runner

from conveyor.config import CacheConfig, DeviceConfig, LoadFormat, ModelConfig, SchedulerConfig, SpeculativeConfig
from conveyor.core.outputs import NO_NEW_BLOCKS, CachedRequestData, NewRequestData, SchedulerOutput
from conveyor.engine.args import parse_speculative_config
from conveyor.sampling_params import SamplingParams
from conveyor.worker.model_runner import ModelRunner


def nano_prompts(batch_size: int, max_prompt: int, seed: int = 0) -> list[list[int]]:
    """nano256's prompts (benchmarks/gpu/offline.py's draws), the first batch_size of them."""
    random.seed(seed)
    return [[random.randint(0, 10000) for _ in range(random.randint(min(100, max_prompt), max_prompt))]
            for _ in range(batch_size)]


class SpecDriver:
    """B requests, prefilled in steps of at most `budget` tokens, then decoded with their drafts."""

    def __init__(self, runner: ModelRunner, prompts: list[list[int]], params: SamplingParams, budget: int) -> None:
        self.runner, self.params = runner, params
        self.ids = [f"r{i}" for i in range(len(prompts))]
        self.num_tokens = {rid: len(p) for rid, p in zip(self.ids, prompts)}
        self.num_computed = dict.fromkeys(self.ids, 0)
        self.drafts: dict[str, list[int]] = {}
        self.num_drafts = self.num_accepted = 0
        blocks_each = -(-runner.max_model_len // runner.block_size)
        new = [NewRequestData(rid, p, [], params, list(range(i * blocks_each, (i + 1) * blocks_each)), 0)
               for i, (rid, p) in enumerate(zip(self.ids, prompts))]
        while new:  # whole prompts, as many as fit the budget (at least one)
            take = 1
            while take < len(new) and sum(len(n.prompt_token_ids) for n in new[: take + 1]) <= budget:
                take += 1
            chunk, new = new[:take], new[take:]
            tokens = {n.request_id: len(n.prompt_token_ids) for n in chunk}
            self._apply(runner.execute(SchedulerOutput(chunk, CachedRequestData(), tokens, sum(tokens.values()))),
                        tokens, {})

    def step(self) -> int:
        """One decode step of every request; returns the output tokens it produced."""
        spec = {rid: d for rid in self.ids if (d := self.drafts.pop(rid, []))}
        tokens = {rid: 1 + len(spec.get(rid, ())) for rid in self.ids}
        cached = CachedRequestData(list(self.ids), [NO_NEW_BLOCKS] * len(self.ids),
                                   [self.num_computed[rid] for rid in self.ids])
        output = self.runner.execute(SchedulerOutput([], cached, tokens, sum(tokens.values()),
                                                     scheduled_spec_decode_tokens=spec))
        return self._apply(output, tokens, spec)

    def _apply(self, output, tokens: dict[str, int], spec: dict[str, list[int]]) -> int:  # noqa: ANN001
        emitted = 0
        for rid, n in tokens.items():
            sampled, num_drafts = output.sampled_token_ids[rid], len(spec.get(rid, ()))
            accepted = len(sampled) - 1
            self.num_drafts, self.num_accepted = self.num_drafts + num_drafts, self.num_accepted + accepted
            self.num_computed[rid] += n - (num_drafts - accepted)
            self.num_tokens[rid] += len(sampled)
            self.drafts[rid] = output.spec_token_ids.get(rid, [])
            emitted += len(sampled)
        return emitted


def make_runner(args: argparse.Namespace, config: SpeculativeConfig | None, max_model_len: int) -> ModelRunner:
    blocks_each = -(-max_model_len // 16)
    runner = ModelRunner(
        ModelConfig(model=args.model, load_format=LoadFormat(args.load_format), dtype=args.dtype,
                    num_hidden_layers_override=args.num_layers),
        CacheConfig(block_size=16, num_blocks_override=args.batch_size * blocks_each, enable_prefix_caching=False),
        SchedulerConfig(max_num_seqs=args.batch_size, max_model_len=max_model_len,
                        max_num_batched_tokens=max(args.budget, args.batch_size * (1 + args.max_drafts))),
        DeviceConfig(device=args.device, enforce_eager=args.enforce_eager, num_threads=args.num_threads), config,
    )
    runner.initialize_kv_cache()
    return runner


def force_full_verification(runner: ModelRunner) -> None:
    """Draft-less steps of this runner go through verify_step (layout, verify_drafts) as before the plain step."""
    decoder = runner.spec_decoder
    assert decoder is not None
    decoder.plain_step = lambda host, sampling: decoder.verify_step(host, sampling, {})  # type: ignore[method-assign]


def timed_steps(driver: SpecDriver, steps: int) -> tuple[float, float]:
    """(median ms per step, output tokens per step) over `steps` steps."""
    times, emitted = [], 0
    for _ in range(steps):
        if driver.runner.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        emitted += driver.step()
        if driver.runner.device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), emitted / steps


def run_rounds(drivers: dict[str, SpecDriver], args: argparse.Namespace, clock: PhaseClock | None
               ) -> tuple[dict[str, list[tuple[float, float]]], dict[str, list[dict[str, float]]]]:
    """Timed rounds in alternating order; per runner, (ms per step, tokens per step) of each round and,
    with a clock, each round's exclusive CPU ms per step by phase."""
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in drivers}
    phases: dict[str, list[dict[str, float]]] = {name: [] for name in drivers}
    names = list(drivers)
    for repeat in range(args.repeats):  # off spec, spec off, ...: a drift of the machine favours neither
        for name in names if repeat % 2 == 0 else names[::-1]:
            if clock is not None:
                clock.take(clock.current)  # what ran outside a round (prefill, the other runner) is dropped
                clock.current = name
            runs[name].append(timed_steps(drivers[name], args.steps))
            if clock is not None:
                cpu_ns, _ = clock.take(name)
                phases[name].append({phase: ns / 1e6 / args.steps for phase, ns in cpu_ns.items()})
    return runs, phases


def phase_table(rounds: list[dict[str, float]]) -> dict[str, list[float]]:
    """phase -> [median, min, max] over the rounds of its ms per step, "total" the sum of the phases."""
    rounds = [{**r, "total": sum(r.values())} for r in rounds]
    names = sorted({phase for r in rounds for phase in r}, key=lambda p: (p == "total", p))
    return {phase: [round(f(r.get(phase, 0.0) for r in rounds), 4) for f in (statistics.median, min, max)]
            for phase in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--load-format", default="auto", choices=[f.value for f in LoadFormat])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--max-prompt", type=int, default=1024)
    parser.add_argument("--budget", type=int, default=8192, help="prefill tokens per step")
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--also-full-verification", action="store_true",
                        help="a third runner whose draft-less steps take the verification path too")
    parser.add_argument("--phases", action="store_true",
                        help="also print each runner's exclusive CPU ms per step by phase (PHASES lines)")
    parser.add_argument("--speculative-config", type=parse_speculative_config,
                        default=parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3, '
                                                         '"prompt_lookup_min": 2, "prompt_lookup_max": 5}'))
    args = parser.parse_args()
    args.max_drafts = args.speculative_config.num_speculative_tokens
    prompts = nano_prompts(args.batch_size, args.max_prompt)
    max_model_len = max(map(len, prompts)) + args.steps * args.repeats * (1 + args.max_drafts) + 2 * args.max_drafts + 16
    params = SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=None)
    configs = {"off": None, "spec": args.speculative_config}
    if args.also_full_verification:
        configs["spec-full"] = args.speculative_config
    drivers = {name: SpecDriver(make_runner(args, config, max_model_len), prompts, params, args.budget)
               for name, config in configs.items()}
    if args.also_full_verification:
        force_full_verification(drivers["spec-full"].runner)
    clock = None
    if args.phases:
        clock = PhaseClock(torch.cuda.synchronize if args.device.startswith("cuda") else None)
        instrument_modules(clock)
        for driver in drivers.values():
            instrument_runner(driver.runner, clock)
            driver.step = clock.wrap("driver", driver.step)  # type: ignore[method-assign]
    runs, phases = run_rounds(drivers, args, clock)
    for name, driver in drivers.items():
        if clock is not None:
            print("PHASES " + json.dumps({"runner": name, "batch_size": args.batch_size,
                                          "cpu_ms_per_step": phase_table(phases[name])}), flush=True)
        ms = [r[0] for r in runs[name]]
        tokens_per_step = statistics.mean(r[1] for r in runs[name])
        print("RESULT " + json.dumps({
            "runner": name, "speculative_config": (args.speculative_config.to_dict() if name != "off" else None),
            "batch_size": args.batch_size, "device": args.device, "ms_per_step_median": round(statistics.median(ms), 3),
            "ms_min": round(min(ms), 3), "ms_max": round(max(ms), 3), "tokens_per_step": round(tokens_per_step, 2),
            "out_tok_per_s": round(tokens_per_step / statistics.median(ms) * 1e3, 1),
            "acceptance_rate": round(driver.num_accepted / driver.num_drafts, 4) if driver.num_drafts else None,
            "num_drafts": driver.num_drafts,
        }), flush=True)


if __name__ == "__main__":
    main()
