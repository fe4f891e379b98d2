#!/usr/bin/env python3
"""The CPU kernels built for two instruction sets on one machine: time them and check they agree.

An AVX-512 machine also runs AVX2 code, so building the same sources with `-march=znver3` (AVX2 + FMA,
no AVX-512: a Zen 3 CI runner) shows here what an AVX2-only CPU gets. Each -march is built into a temp
directory (`cpu_build.build_for`), and the hot entry points are timed at SmolLM2-135M's shapes: the GGUF
block matmuls (Q4 projections, the Q8_0 LM head) for 1 to 64 input rows, and the paged decode attention.
Every output is compared with the first build's (and the matmuls with the torch reference).

    PYTHONPATH=src python benchmarks/cpu_isa.py --march native znver3 --threads 1

Prints one line per kernel and shape: the median microseconds per call of each build, the max abs
difference to the first build and to the reference.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import pathlib
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from conveyor.kernels import gguf_matmul
from conveyor.kernels.cpu_build import build_for

Q4_SHAPES = ((576, 576), (192, 576), (1536, 576), (576, 1536))
"""SmolLM2-135M's Q4 projections as (N, K): q/o, k/v, gate/up, down."""
LM_HEAD = (49152, 576)
"""The Q8_0 LM head (tied embedding)."""


@dataclasses.dataclass(frozen=True)
class Timing:
    """One kernel call at one shape on one build: median microseconds, and its output."""

    micros: float
    out: torch.Tensor


def time_call(call: Callable[[], torch.Tensor], reps: int) -> Timing:
    out = call()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        samples.append((time.perf_counter() - start) * 1e6)
    return Timing(statistics.median(samples), out)


def q4_call(lib: ctypes.CDLL, x: torch.Tensor, w: tuple[torch.Tensor, ...], threads: int) -> Callable[[], torch.Tensor]:
    qs, d, m = w
    out = torch.empty((x.shape[0], qs.shape[0]))

    def call() -> torch.Tensor:
        lib.q4_matmul(x.data_ptr(), x.shape[0], x.shape[1], qs.data_ptr(), d.data_ptr(), m.data_ptr(),
                      qs.shape[0], out.data_ptr(), threads)
        return out.clone()
    return call


def q8_call(lib: ctypes.CDLL, x: torch.Tensor, w: tuple[torch.Tensor, ...], threads: int) -> Callable[[], torch.Tensor]:
    qs, d = w
    out = torch.empty((x.shape[0], qs.shape[0]))

    def call() -> torch.Tensor:
        lib.q8_0_matmul(x.data_ptr(), x.shape[0], x.shape[1], qs.data_ptr(), d.data_ptr(), qs.shape[0],
                        out.data_ptr(), threads)
        return out.clone()
    return call


def q4_weight(n: int, k: int) -> tuple[torch.Tensor, ...]:
    return (torch.randint(0, 256, (n, k // 2), dtype=torch.uint8), torch.rand(n, k // 32) * 0.02,
            -torch.rand(n, k // 32) * 0.1)


def q8_weight(n: int, k: int) -> tuple[torch.Tensor, ...]:
    return torch.randint(-128, 128, (n, k), dtype=torch.int8), torch.rand(n, k // 32) * 0.01


def report(name: str, timings: list[Timing], reference: torch.Tensor) -> None:
    cells = [f"{t.micros:9.1f} us" for t in timings]
    first = timings[0].out
    diff = max(float((t.out - first).abs().max()) for t in timings)
    ref = max(float((t.out - reference).abs().max()) for t in timings)
    scale = float(reference.abs().max())
    print(f"{name:28s} " + " ".join(cells) + f"   |builds| {diff:.2e}  |ref| {ref:.2e} (of {scale:.1e})", flush=True)


def bench_matmuls(libs: list[ctypes.CDLL], rows: list[int], threads: int, reps: int) -> None:
    torch.manual_seed(0)
    cases = [("q4", n, k, q4_weight(n, k)) for n, k in Q4_SHAPES] + [("q8_0", *LM_HEAD, q8_weight(*LM_HEAD))]
    for kind, n, k, w in cases:
        for m in rows:
            x = torch.randn(m, k)
            make = q4_call if kind == "q4" else q8_call
            reference = (gguf_matmul.q4_matmul_ref(x, *w) if kind == "q4" else gguf_matmul.q8_0_matmul_ref(x, *w))
            timings = [time_call(make(lib, x, w, threads), reps if n < 10000 else max(3, reps // 10)) for lib in libs]
            report(f"{kind} N={n} K={k} M={m}", timings, reference)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--march", nargs="+", default=["native", "znver3"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 64])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        libs = [build_for(march, pathlib.Path(tmp) / f"kernels_{march}.so") for march in args.march]
        print("columns: " + " ".join(args.march), flush=True)
        bench_matmuls(libs, args.rows, args.threads, args.reps)


if __name__ == "__main__":
    main()
