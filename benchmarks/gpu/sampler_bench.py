#!/usr/bin/env python3
"""The sampler's per-step cost: the staged path (float32 copy of the LM head's bf16 logits, divide,
softmax, exponential noise, argmax) against the fused path's inverse-CDF kernels (kernels/cdf_sample.py)
reading the bf16 logits.

Every row does plain temperature sampling (the fused path's case). Times are CUDA events around one
call each, warm-up calls excluded, median of --iters: `staged_ms` includes the `.float()` the runner
paid before the fused path existed; `fused_ms` is `Sampler.sample` (seed draw + kernel launches),
`kernel_ms` the two kernels alone. Prints one JSON line per shape ("RESULT {...}").

    python benchmarks/gpu/sampler_bench.py [--num-rows 1 64 256 1024] [--vocab-sizes 128256 151936]
    python benchmarks/gpu/sampler_bench.py --dry-run    # CPU: arguments, shapes, the reference path
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import torch

from conveyor.kernels.cdf_sample import cdf_sample, cdf_sample_ref, cdf_sample_supported
from conveyor.kernels.triton_compat import triton
from conveyor.sampling_params import SamplingParams
from conveyor.worker.sampler import Sampler, SamplingPath, sampling_path, staged_sample
from conveyor.worker.sampling_metadata import SamplingBatch, SamplingRequest, VocabInfo, build_sampling_batch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-rows", type=int, nargs="+", default=[1, 64, 256, 1024], help="rows N per step")
    parser.add_argument("--vocab-sizes", type=int, nargs="+", default=[128256, 151936], help="vocabulary V")
    parser.add_argument("--temperature", type=float, default=1.0, help="every row's temperature (> 0)")
    parser.add_argument("--iters", type=int, default=50, help="timed calls per path (the median is reported)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed calls per path first (compiles)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, no timing: one call of each path per shape")
    args = parser.parse_args(argv)
    if min(args.num_rows) < 1 or min(args.vocab_sizes) < 2:
        parser.error("--num-rows must be >= 1 and --vocab-sizes >= 2")
    if args.temperature <= 0.0:
        parser.error("--temperature must be > 0 (temperature 0 is greedy: one argmax, nothing to compare)")
    if args.iters < 1 or args.warmup < 0:
        parser.error("--iters must be >= 1 and --warmup >= 0")
    if not args.dry_run and not (torch.cuda.is_available() and cdf_sample_supported(torch.device("cuda"))):
        parser.error("needs CUDA and Triton: run on the GPU, or pass --dry-run to check the script on the CPU")
    return args


def make_case(num_rows: int, vocab_size: int, temperature: float, device: torch.device
              ) -> tuple[torch.Tensor, SamplingBatch]:
    """Random bf16 logits [N, V] as the LM head returns them, and N plain temperature requests."""
    logits = (torch.randn(num_rows, vocab_size, device=device) * 3).bfloat16()
    requests = [SamplingRequest(SamplingParams(temperature=temperature), [0, 1], 1)] * num_rows
    batch = build_sampling_batch(requests, VocabInfo(vocab_size, frozenset()), device)
    return logits, batch


def median_ms(fn: Callable[[], object], iters: int, warmup: int) -> float:
    """Median of `iters` CUDA-event timings of one call each, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times: list[float] = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(num_rows: int, vocab_size: int, args: argparse.Namespace) -> dict[str, object]:
    device = torch.device("cuda")
    logits, batch = make_case(num_rows, vocab_size, args.temperature, device)
    assert batch.random is not None and sampling_path(batch, True) is SamplingPath.FUSED
    random = batch.random
    generator = torch.Generator(device=device).manual_seed(0)
    sampler = Sampler(generator)
    seed = torch.zeros(1, dtype=torch.int64, device=device)
    staged = median_ms(lambda: staged_sample(logits.float(), random, generator), args.iters, args.warmup)
    fused = median_ms(lambda: sampler.sample(logits, batch), args.iters, args.warmup)
    kernel = median_ms(lambda: cdf_sample(logits, random.temperature, seed), args.iters, args.warmup)
    greedy = cdf_sample(logits, torch.zeros(num_rows, device=device), seed)
    return {
        "num_rows": num_rows, "vocab_size": vocab_size, "temperature": args.temperature,
        "staged_ms": round(staged, 4), "fused_ms": round(fused, 4), "kernel_ms": round(kernel, 4),
        "saved_ms": round(staged - fused, 4), "speedup": round(staged / fused, 2),
        "greedy_is_argmax": bool(torch.equal(greedy, logits.argmax(dim=-1))),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": getattr(triton, "__version__", None),
    }


def dry_run(num_rows: int, vocab_size: int, args: argparse.Namespace) -> dict[str, object]:
    """The same shapes through the staged path and the kernel's reference, on the CPU."""
    logits, batch = make_case(num_rows, vocab_size, args.temperature, torch.device("cpu"))
    assert batch.random is not None and sampling_path(batch, False) is SamplingPath.STAGED
    generator = torch.Generator().manual_seed(0)
    staged = staged_sample(logits.float(), batch.random, generator)
    uniform = torch.rand(num_rows, generator=generator)
    fused = cdf_sample_ref(logits, batch.random.temperature, uniform)
    greedy = cdf_sample_ref(logits, torch.zeros(num_rows), uniform)
    assert staged.shape == fused.shape == (num_rows,) and int(fused.max()) < vocab_size
    assert torch.equal(greedy, logits.argmax(dim=-1))
    return {"num_rows": num_rows, "vocab_size": vocab_size, "temperature": args.temperature, "dry_run": True}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    for vocab_size in args.vocab_sizes:
        for num_rows in args.num_rows:
            row = dry_run(num_rows, vocab_size, args) if args.dry_run else measure(num_rows, vocab_size, args)
            print("RESULT " + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
