#!/usr/bin/env python3
"""One online-shaped mixed step against a decode step, timed and split by kernel (issue 38's TPOT gap).

Session 14's step logs put conveyor's online mixed steps (~1,200 prefill tokens beside ~55 decodes, 16 req/s)
at 75% of their roofline bound, with ~4.3 ms fixed per step, where decode-only steps reach 92%. This script
rebuilds that batch offline so one step can be profiled: D running requests of C context tokens each, then
one new prompt of P tokens joins them, so the next step is D decodes + a P-token prefill chunk. Steps run
synchronously (no async scheduling), one `core.step()` each, so each timed step is one batch.

    PYTHONPATH=src python3 benchmarks/gpu/mixed_profile.py --model benchmarks/models/llama-3.1-8b \
        --decodes 55 --context 1500 --prefill 1200 --repeats 8 --profile-out $OUT/mixed_prof.txt

Prints one JSON line ("RESULT {...}"): median decode-step and mixed-step ms, and each one's roofline bound
from --hbm-gb-s / --tflops (the machine's `roofline.py --measure` ceilings). The profile table (kernels by
GPU time over one mixed step and one decode step) goes to --profile-out.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import offline  # noqa: E402  (engine_config: the same engine offline.py builds)
import roofline  # noqa: E402  (model_shape: the bound's parameter and KV byte counts)

from conveyor.request import Request  # noqa: E402
from conveyor.sampling_params import SamplingParams  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--num-layers", type=int, default=None, help="truncate the model (smoke tests)")
    parser.add_argument("--decodes", type=int, default=55, help="running requests decoding beside the prefill")
    parser.add_argument("--context", type=int, default=1500, help="each running request's prompt tokens")
    parser.add_argument("--prefill", type=int, default=1200, help="the joining prompt's tokens (one chunk)")
    parser.add_argument("--repeats", type=int, default=8, help="mixed steps timed (one new prompt each)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192, help="the online default")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.92)
    parser.add_argument("--hbm-gb-s", type=float, default=3039.0, help="measured HBM bandwidth (s14's H100)")
    parser.add_argument("--tflops", type=float, default=700.7, help="measured dense bf16 TFLOP/s (s14's H100)")
    parser.add_argument("--profile-out", default=None, help="write the kernel table here (needs CUDA)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.prefill + args.decodes > args.max_num_batched_tokens:
        parser.error("--prefill plus --decodes must fit in --max-num-batched-tokens (one chunk, one step)")
    # The fields offline.engine_config reads, at offline.py's defaults where this script has no flag.
    extra = dict(quantization="none", gemm_backend="torch", max_num_seqs=min(1024, args.max_num_batched_tokens),
                 block_size=16, kv_cache_dtype="auto",
                 async_scheduling=False, enforce_eager=False, speculative_config=None, tensor_parallel_size=1)
    for key, value in extra.items():
        setattr(args, key, value)
    return args


def add_prompts(core, tag: str, count: int, length: int, max_tokens: int, rng: random.Random) -> None:
    """Random-id prompts (no shared prefix), ignore_eos so they run exactly max_tokens."""
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=max_tokens)
    for index in range(count):
        ids = [rng.randint(0, 10000) for _ in range(length)]
        core.add_request(Request(f"{tag}{index}", ids, params, time.monotonic()))


def timed_step(core, sync: Callable[[], None]) -> tuple[float, tuple[int, int]]:
    """One step's wall time, and its batch as (prompt tokens, generated tokens)."""
    sync()
    tick = time.perf_counter()
    stats = core.step().stats
    sync()
    return time.perf_counter() - tick, (stats.num_prompt_tokens, stats.num_generation_tokens)


Batch = tuple[str, int, int]
"""A timed step's kind and batch: ("decode" | "mixed", prompt tokens, generated tokens)."""


def measure(core, args: argparse.Namespace, sync: Callable[[], None]) -> tuple[list[float], list[float], set[Batch]]:
    """Fill D running requests, then alternate: a decode step, a mixed step (one new P-token prompt).
    Also returns the batches the steps ran, so a run that did not build the intended ones says so."""
    rng = random.Random(args.seed)
    add_prompts(core, "run", args.decodes, args.context, 4 * args.repeats + 64, rng)
    prefill_steps = -(-args.decodes * args.context // args.max_num_batched_tokens) + 2
    for _ in range(prefill_steps):  # all D prompts prefilled, each has sampled its first token
        core.step()
    decode_s: list[float] = []
    mixed_s: list[float] = []
    batches: set[Batch] = set()
    for repeat in range(args.repeats):
        seconds, batch = timed_step(core, sync)
        decode_s.append(seconds)
        batches.add(("decode", *batch))
        add_prompts(core, f"join{repeat}_", 1, args.prefill, 1, rng)  # one token: it leaves after its prefill
        seconds, batch = timed_step(core, sync)
        mixed_s.append(seconds)
        batches.add(("mixed", *batch))
    return decode_s, mixed_s, batches


def bounds_ms(args: argparse.Namespace, config: dict) -> tuple[float, float]:
    """Roofline bound of the decode step and of the mixed step: max(bytes / HBM, FLOPs / peak).

    The LM head runs on the sampled rows only (a prefill chunk samples one), so its FLOPs count per row,
    the decoder's per token; attention FLOPs count each (query, key) pair, causal inside the prefill."""
    shape = roofline.model_shape(config)
    lm_head = config["vocab_size"] * config["hidden_size"]
    decoder = shape.num_params - lm_head
    context = args.decodes * (args.context + 2 * args.repeats)
    hbm, peak = args.hbm_gb_s * 1e9, args.tflops * 1e12
    rows = args.decodes
    decode_flops = 2 * shape.num_params * rows + shape.attn_flops_per_pair * context
    decode = max((2 * shape.num_params + context * shape.kv_bytes_per_token) / hbm, decode_flops / peak)
    pairs = context + args.prefill * (args.prefill + 1) // 2
    mixed_flops = 2 * decoder * (rows + args.prefill) + 2 * lm_head * (rows + 1) + shape.attn_flops_per_pair * pairs
    mixed_bytes = 2 * shape.num_params + (context + args.prefill) * shape.kv_bytes_per_token
    return decode * 1e3, max(mixed_bytes / hbm, mixed_flops / peak) * 1e3


def profile_pair(core, args: argparse.Namespace) -> str:
    """torch.profiler over one decode step and one mixed step: kernels by GPU time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        core.step()
        add_prompts(core, "prof", 1, args.prefill, 1, random.Random(args.seed + 1))
        core.step()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=45)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    core = offline.build_engine_core(offline.engine_config(args))
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    decode_s, mixed_s, batches = measure(core, args, sync)
    expected = {("decode", 0, args.decodes), ("mixed", args.prefill, args.decodes + 1)}
    config = json.loads((pathlib.Path(args.model) / "config.json").read_text())
    if args.num_layers is not None:
        config["num_hidden_layers"] = args.num_layers
    decode_bound, mixed_bound = bounds_ms(args, config)
    decode_ms, mixed_ms = statistics.median(decode_s) * 1e3, statistics.median(mixed_s) * 1e3
    if args.profile_out and cuda:
        pathlib.Path(args.profile_out).write_text(profile_pair(core, args))
    core.shutdown()
    result = {"model": pathlib.Path(args.model).name, "decodes": args.decodes, "context": args.context,
              "prefill": args.prefill, "decode_step_ms": round(decode_ms, 3), "mixed_step_ms": round(mixed_ms, 3),
              "decode_bound_ms": round(decode_bound, 3), "mixed_bound_ms": round(mixed_bound, 3),
              "decode_fraction_of_bound": round(decode_bound / decode_ms, 3),
              "mixed_fraction_of_bound": round(mixed_bound / mixed_ms, 3),
              "decode_steps_ms": [round(s * 1e3, 2) for s in decode_s],
              "mixed_steps_ms": [round(s * 1e3, 2) for s in mixed_s], "gpu": offline._gpu_name(),
              "batches_as_intended": batches == expected, "batches": sorted(batches)}
    print("RESULT " + json.dumps(result), flush=True)
    return 0 if batches == expected else 1


if __name__ == "__main__":
    sys.exit(main())
