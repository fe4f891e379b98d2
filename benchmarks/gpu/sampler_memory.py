#!/usr/bin/env python3
"""One sampler call's peak GPU memory, chunked and unchunked: what the start-up profile reserves of it.

The call is the memory profile's own sampler step (worker/warmup.profile_sampling_requests: every row at
temperature 1.0, top-p 0.9, the staged path's heaviest variant) on random bf16 logits [N, V] as the LM
head returns them. Peak = torch.cuda.max_memory_allocated during the call minus what was allocated
before it (the logits included), so it counts the sampler's float32 copy, the shared noise and the
staged temporaries -- the quantity `bench/plan/sampler_memory.sampler_bytes` models. "chunked" is the
engine's sampler (row chunks of SAMPLER_CHUNK_BYTES), "unchunked" the same code in one whole-batch
pass; `same_tokens` says whether both drew the same tokens from the same seed, `ms` is one call's time
(median of --iters, after one untimed call). Prints one JSON line per case ("RESULT {...}"); without
CUDA it prints a skip line and exits 0.

    python benchmarks/gpu/sampler_memory.py [--num-rows 256 1024] [--vocab-sizes 128256 151936]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from conveyor.bench.plan.sampler_memory import sampler_bytes, unchunked_sampler_bytes
from conveyor.worker.sampler import Sampler
from conveyor.worker.sampler_staged import SAMPLER_CHUNK_BYTES, rows_per_chunk
from conveyor.worker.sampling_metadata import (
    SamplingBatch,
    VocabInfo,
    build_sampling_batch,
)
from conveyor.worker.warmup import profile_sampling_requests

GIB = 1 << 30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-rows", type=int, nargs="+", default=[256, 1024], help="rows N of one call")
    parser.add_argument("--vocab-sizes", type=int, nargs="+", default=[128256, 151936], help="vocabulary V")
    parser.add_argument("--iters", type=int, default=5, help="timed calls per case (the median is reported)")
    args = parser.parse_args(argv)
    if min(args.num_rows) < 1 or min(args.vocab_sizes) < 2 or args.iters < 1:
        parser.error("--num-rows and --iters must be >= 1, --vocab-sizes >= 2")
    return args


def one_call(logits: torch.Tensor, batch: SamplingBatch, chunk_bytes: int | None) -> torch.Tensor:
    """[N] token ids of the profile's sampler step from a fixed seed (logits [N, V] bf16, not modified)."""
    sampler = Sampler(torch.Generator(device=logits.device).manual_seed(0), chunk_bytes)
    return sampler.sample(logits, batch)


def peak_bytes(logits: torch.Tensor, batch: SamplingBatch, chunk_bytes: int | None) -> tuple[int, torch.Tensor]:
    """(bytes allocated at the call's peak beyond those before it, the tokens it drew)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    tokens = one_call(logits, batch, chunk_bytes)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before, tokens


def median_ms(logits: torch.Tensor, batch: SamplingBatch, chunk_bytes: int | None, iters: int) -> float:
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        one_call(logits, batch, chunk_bytes)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(statistics.median(times))


def measure(num_rows: int, vocab_size: int, iters: int) -> list[dict[str, object]]:
    """Both cases of one shape: the unchunked one first (its tokens are the reference)."""
    device = torch.device("cuda")
    logits = (torch.randn(num_rows, vocab_size, device=device) * 3).bfloat16()  # [N, V] as the LM head's
    batch = build_sampling_batch(profile_sampling_requests(num_rows), VocabInfo(vocab_size, frozenset()), device)
    rows: list[dict[str, object]] = []
    reference = None
    for chunked, chunk_bytes, model in ((False, None, unchunked_sampler_bytes), (True, SAMPLER_CHUNK_BYTES, sampler_bytes)):
        one_call(logits, batch, chunk_bytes)  # kernels loaded before the measured call
        peak, tokens = peak_bytes(logits, batch, chunk_bytes)
        reference = tokens if reference is None else reference
        rows.append({
            "num_rows": num_rows, "vocab_size": vocab_size, "chunked": chunked,
            "rows_per_chunk": min(rows_per_chunk(vocab_size, chunk_bytes) or num_rows, num_rows),
            "peak_bytes": peak, "peak_gib": round(peak / GIB, 4),
            "bytes_per_logit": round(peak / (num_rows * vocab_size), 2),
            "plan_gib": round(model(num_rows, vocab_size) / GIB, 4),
            "same_tokens": bool(torch.equal(tokens, reference)),
            "ms": round(median_ms(logits, batch, chunk_bytes, iters), 3),
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        })
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("SKIP " + json.dumps({"skipped": "needs CUDA: run on the GPU"}), flush=True)
        return
    for vocab_size in args.vocab_sizes:
        for num_rows in args.num_rows:
            for row in measure(num_rows, vocab_size, args.iters):
                print("RESULT " + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
