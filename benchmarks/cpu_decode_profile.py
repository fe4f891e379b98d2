#!/usr/bin/env python3
"""Where a batch-1 CPU decode step goes (issue 39, item 2), against the memory-bandwidth floor.

Builds the engine's own `ModelRunner` on the embedded SmolLM2 Q4_1 GGUF (the `conveyor serve`
default: GGUF blocks, the C attention, one C call for the decoder stack), prefills one `--context`
token prompt, then:
  1. times `--steps` batch-1 decode steps through `ModelRunner.execute` (wall clock: median, p90);
  2. profiles `--profile-steps` more with torch.profiler (CPU); ctypes calls into the C kernels are
     invisible to it, so each C function is wrapped in a `record_function` named `c:<function>`, and
     the runner's phases (host inputs, LM head, sampling) in `phase:<name>` ranges. Every op's self
     time goes to the nearest phase above it; "Python" is the profiled step's wall time minus the sum
     of all op and C self times (what no op accounts for: Python, ctypes, the profiler's own cost);
  3. the decoder stack is one C call, so its inside is apportioned from a second profile of the
     per-layer module path (the same kernels, one ctypes call each): Q4 matmuls, attention, the rest;
  4. the floor: bytes of weights a decode step reads (every layer's tensors, the final norm, the
     LM head, which is the tied Q8_0 embedding) / a measured read bandwidth (a torch sum over 512 MB
     at the run's thread count), as GGUF bytes (what llama.cpp reads) and as conveyor's resident
     bytes (scales and mins held as float32, not float16);
  5. the in-process engine's per-token cost beyond the step (`LLM.generate`, one greedy request:
     median inter-token gap minus the median step): scheduler, output processing, detokenization.
     With `--served`, also one greedy stream from `conveyor serve` at the same thread count (the
     served ITL minus the in-process gap: the engine-process to API hand-off and the SSE stream).

    PYTHONPATH=src python benchmarks/cpu_decode_profile.py --threads 1
    PYTHONPATH=src python benchmarks/cpu_decode_profile.py --dry-run      # a few steps, for the test

Prints a table and one `RESULT {json}` line (times in ms).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch.profiler import ProfilerActivity, profile, record_function
from worker_step import HEADROOM_TOKENS, DecodeDriver

from conveyor.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig
from conveyor.kernels.cpu_build import cpu_kernels
from conveyor.model.gguf_weights import read_gguf
from conveyor.model.loader import embedded_gguf_path
from conveyor.worker import model_runner as model_runner_module
from conveyor.worker.model_runner import ModelRunner

C_FUNCTIONS = ("q4_matmul", "q8_0_matmul", "paged_decode_attention", "paged_prefill_attention", "rms_norm",
               "rotary_", "silu_and_mul", "decoder_stack")
MATMUL_C, ATTENTION_C = {"c:q4_matmul"}, {"c:paged_decode_attention", "c:paged_prefill_attention"}
PHASES = ("host_inputs", "lm_head", "sampling")
"""The runner's phases wrapped in `phase:` ranges; ops under none of them are "other torch ops"."""


def build_runner(threads: int, context: int) -> ModelRunner:
    max_len = context + HEADROOM_TOKENS
    runner = ModelRunner(ModelConfig(), CacheConfig(num_blocks_override=2 * -(-max_len // 16)),
                         SchedulerConfig(max_num_seqs=2, max_model_len=max_len, max_num_batched_tokens=2048),
                         DeviceConfig(num_threads=threads))
    runner.initialize_kv_cache()
    return runner


def _ranged(name: str, fn: Callable[..., object]) -> Callable[..., object]:
    def wrapped(*args: object, **kwargs: object) -> object:
        with record_function(name):
            return fn(*args, **kwargs)
    return wrapped


@contextmanager
def instrumented(runner: ModelRunner) -> Iterator[None]:
    """C functions and the runner's phases wrapped in profiler ranges; undone on exit."""
    lib = cpu_kernels()
    originals = {name: getattr(lib, name) for name in C_FUNCTIONS}
    for name, fn in originals.items():
        setattr(lib, name, _ranged(f"c:{name}", fn))  # CDLL caches functions as attributes: this shadows them
    patches = [(model_runner_module, "prepare_host_batch"), (runner.staging, "device_batch"),
               (runner.model, "lm_head_logits"), (runner.sampler, "sample"), (runner, "_sampling_batch")]
    phase_of = {"prepare_host_batch": "host_inputs", "device_batch": "host_inputs", "lm_head_logits": "lm_head",
                "sample": "sampling", "_sampling_batch": "sampling"}
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr in patches]
    for owner, attr, fn in saved:
        setattr(owner, attr, _ranged(f"phase:{phase_of[attr]}", fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(lib, name, fn)
        for owner, attr, fn in saved:
            if owner is model_runner_module:
                setattr(owner, attr, fn)
            else:
                delattr(owner, attr)  # the instance attribute shadowed the class's method


def time_steps(driver: DecodeDriver, num_steps: int) -> list[float]:
    times = []
    for _ in range(num_steps):
        start = time.perf_counter()
        driver.step()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def _category(event: object) -> str | None:
    """The category of one event's self time; None for a phase range (its self time is Python)."""
    name: str = event.name  # type: ignore[attr-defined]
    if name.startswith("c:"):
        return name
    if name.startswith(("phase:", "step")):
        return None
    parent = event.cpu_parent  # type: ignore[attr-defined]
    while parent is not None:
        if parent.name.startswith("phase:"):
            return parent.name
        parent = parent.cpu_parent
    return "torch:other"


def profile_steps(driver: DecodeDriver, runner: ModelRunner, num_steps: int) -> dict[str, float]:
    """Per step: ms of self time by category, `op_calls` (torch ops), `c_calls` and the profiled wall."""
    with instrumented(runner), profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for index in range(num_steps):
            with record_function(f"step{index}"):
                driver.step()
        wall_ms = (time.perf_counter() - start) * 1e3
    totals: dict[str, float] = defaultdict(float)
    calls: Counter[str] = Counter()
    for event in prof.events():
        if event.name.startswith("phase:"):  # inclusive: its Python and the ops inside
            totals["incl:" + event.name] += event.cpu_time_total / 1e3
        category = _category(event)
        if category is None:
            continue
        totals[category] += event.self_cpu_time_total / 1e3
        calls["c_calls" if category.startswith("c:") else "op_calls"] += 1
    per_step = {name: ms / num_steps for name, ms in totals.items()}
    per_step["wall"] = wall_ms / num_steps
    self_ms = sum(ms for name, ms in per_step.items() if name != "wall" and not name.startswith("incl:"))
    per_step["python"] = per_step["wall"] - self_ms
    return {**per_step, **{name: count / num_steps for name, count in calls.items()}}


def stack_shares(runner: ModelRunner, driver: DecodeDriver, num_steps: int) -> dict[str, float]:
    """Fractions of the C kernels' time inside a layer (matmul, attention, rest) from the module path."""
    runner.model.__dict__["cpu_stack"] = None  # cached_property: the per-layer modules take the steps
    try:
        split = profile_steps(driver, runner, num_steps)
    finally:
        del runner.model.__dict__["cpu_stack"]
    layer_c = {name: ms for name, ms in split.items() if name.startswith("c:") and name != "c:q8_0_matmul"}
    total = sum(layer_c.values())
    matmul = sum(ms for name, ms in layer_c.items() if name in MATMUL_C)
    attention = sum(ms for name, ms in layer_c.items() if name in ATTENTION_C)
    return {"matmul": matmul / total, "attention": attention / total, "rest": (total - matmul - attention) / total,
            "module_path_step_ms": split["wall"], "module_path_op_calls": split.get("op_calls", 0.0),
            "module_path_c_calls": split.get("c_calls", 0.0)}


def weight_bytes(runner: ModelRunner) -> dict[str, int]:
    """Bytes one decode step reads of the weights: in the GGUF file and as conveyor holds them."""
    gguf = read_gguf(embedded_gguf_path())
    gguf_bytes = 0
    for info in gguf.tensors:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(info.ggml_type)]
        gguf_bytes += int(torch.Size(info.shape).numel()) * size // block
    seen, resident = set(), 0
    for name, tensor in [*runner.model.named_parameters(), *runner.model.named_buffers()]:
        if "inv_freq" in name or tensor.data_ptr() in seen:
            continue  # rope's frequencies are not a weight
        seen.add(tensor.data_ptr())
        resident += tensor.numel() * tensor.element_size()
    return {"gguf": gguf_bytes, "resident": resident}


def read_bandwidth_gbs(megabytes: int = 512, repeats: int = 5) -> float:
    """Best of `repeats` reads of a large float32 tensor (a sum: one FMA per 4 bytes, memory-bound)."""
    data = torch.ones(megabytes * 2**20 // 4)
    data.sum()  # fault the pages in
    best = min(_seconds(data.sum) for _ in range(repeats))
    return data.numel() * 4 / best / 1e9


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def engine_gap_ms(threads: int, context: int, num_tokens: int) -> float:
    """Median inter-token gap of one greedy request through the in-process engine (`LLM`)."""
    from conveyor.engine.llm import LLM
    from conveyor.sampling_params import SamplingParams

    llm = LLM(num_threads=threads, max_num_seqs=2, max_model_len=context + HEADROOM_TOKENS)
    prompt = [(7 * j) % 1000 + 10 for j in range(context)]
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    llm.generate([prompt], params)  # warm: first-request costs stay out
    result = llm.generate([prompt], params)[0]
    times = result.timings.token_times_s
    return statistics.median(b - a for a, b in itertools.pairwise(times)) * 1e3


def served_itl_ms(threads: int, num_tokens: int) -> float:
    """Median inter-chunk gap of one greedy stream from `conveyor serve` (engine process + API process)."""
    from serve_streams import run_level, start_server

    proc, url = start_server(["--num-threads", str(threads), "--max-model-len", "512", "--max-num-seqs", "8"])
    try:
        return float(asyncio.run(run_level(url, 1, num_tokens))["itl_p50_ms"])
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def split_table(profiled: dict[str, float], shares: dict[str, float]) -> list[tuple[str, float, str]]:
    """(row, ms per profiled step, calls) for the table, the stack apportioned by `shares`."""
    stack = profiled.get("c:decoder_stack", 0.0)
    layer_c = {k: v for k, v in profiled.items() if k.startswith("c:") and k not in ("c:decoder_stack", "c:q8_0_matmul")}
    matmul = stack * shares["matmul"] + sum(v for k, v in layer_c.items() if k in MATMUL_C)
    attention = stack * shares["attention"] + sum(v for k, v in layer_c.items() if k in ATTENTION_C)
    rest = stack * shares["rest"] + sum(v for k, v in layer_c.items() if k not in MATMUL_C | ATTENTION_C)
    head_c = profiled.get("c:q8_0_matmul", 0.0)
    rows = [
        ("Q4 block matmuls (C; inside the stack apportioned)", matmul, "120"),
        ("LM head, Q8_0 block matmul (C)", head_c, "1"),
        ("paged decode attention (C; apportioned)", attention, "30"),
        ("norms, rope, SiLU, K/V store, adds (C; apportioned)", rest, "-"),
        ("LM head around the kernel (Python, checks)", profiled.get("incl:phase:lm_head", 0.0) - head_c, "-"),
        ("host inputs (numpy, torch copies, Python)", profiled.get("incl:phase:host_inputs", 0.0), "-"),
        ("sampling (metadata + greedy, Python)", profiled.get("incl:phase:sampling", 0.0), "-"),
        ("other torch ops (embedding, rope table, final norm, views)", profiled.get("torch:other", 0.0), "-"),
    ]
    return [*rows, ("the rest: runner and stack Python, ctypes, profiler", profiled["wall"] - sum(r[1] for r in rows), "-")]


def print_report(result: dict[str, object], rows: list[tuple[str, float, str]], wall: float) -> None:
    print(f"threads {result['threads']}, context {result['context']}: step median {result['step_ms_median']:.2f} ms, "
          f"p90 {result['step_ms_p90']:.2f} ms; profiled step {wall:.2f} ms, "
          f"{result['op_calls_per_step']:.0f} torch op calls + {result['c_calls_per_step']:.0f} C calls per step")
    print("| part | ms / profiled step | share | calls |\n|---|---:|---:|---:|")
    for name, ms, calls in rows:
        print(f"| {name} | {ms:.2f} | {100 * ms / wall:.0f}% | {calls} |")
    print(f"not in any op or C call (wall - op and C self times): {result['python_ms']:.2f} ms per profiled step")
    print(f"floor: {result['weight_mb_gguf']:.1f} MB (GGUF) / {result['weight_mb_resident']:.1f} MB (resident) "
          f"at {result['read_gbs']:.1f} GB/s = {result['floor_ms_gguf']:.2f} / {result['floor_ms_resident']:.2f} ms")
    gap, served = result.get("engine_gap_ms"), result.get("served_itl_ms")
    print(f"in-process engine (LLM.generate): median token gap {gap} ms (step + scheduler + output processing)"
          if gap is not None else "in-process engine gap: not measured")
    print(f"served (conveyor serve, one stream): median ITL {served} ms (+ engine-process to API hand-off, SSE)"
          if served is not None else "engine-process to API hand-off: not measured (--served)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, choices=[1, 2])
    parser.add_argument("--context", type=int, default=32, help="prompt tokens before the timed decodes")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--profile-steps", type=int, default=30)
    parser.add_argument("--engine-tokens", type=int, default=64, help="0: skip the in-process engine run")
    parser.add_argument("--served", action="store_true", help="also time one stream from `conveyor serve`")
    parser.add_argument("--dry-run", action="store_true", help="a few steps of everything (the test's mode)")
    args = parser.parse_args()
    if args.dry_run:
        args.steps, args.profile_steps, args.engine_tokens = 3, 2, 4
    runner = build_runner(args.threads, args.context)
    driver = DecodeDriver(runner, 1, args.context)
    time_steps(driver, 3)  # warm
    times = sorted(time_steps(driver, args.steps))
    profiled = profile_steps(driver, runner, args.profile_steps)
    shares = stack_shares(runner, driver, args.profile_steps)
    weights, bandwidth = weight_bytes(runner), read_bandwidth_gbs(64 if args.dry_run else 512)
    result: dict[str, object] = {
        "threads": args.threads, "context": args.context, "steps": args.steps, "torch": torch.__version__,
        "step_ms_median": statistics.median(times), "step_ms_p90": times[int(0.9 * (len(times) - 1))],
        "profiled_step_ms": profiled["wall"], "op_calls_per_step": profiled.get("op_calls", 0.0),
        "c_calls_per_step": profiled.get("c_calls", 0.0), "python_ms": profiled["python"], "split_ms": {k: round(v, 3) for k, v in profiled.items()},
        "stack_shares": {k: round(v, 4) for k, v in shares.items()}, "read_gbs": bandwidth,
        "weight_mb_gguf": weights["gguf"] / 1e6, "weight_mb_resident": weights["resident"] / 1e6,
        "floor_ms_gguf": weights["gguf"] / bandwidth / 1e6, "floor_ms_resident": weights["resident"] / bandwidth / 1e6,
    }
    if args.engine_tokens:
        gap = engine_gap_ms(args.threads, args.context, args.engine_tokens)
        result.update(engine_gap_ms=round(gap, 3), engine_overhead_ms=round(gap - statistics.median(times), 3))
    if args.served:
        result["served_itl_ms"] = served_itl_ms(args.threads, 4 if args.dry_run else 128)
    print_report(result, split_table(profiled, shares), profiled["wall"])
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
