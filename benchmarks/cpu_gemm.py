#!/usr/bin/env python3
"""Float32 GEMM on this CPU: torch's F.linear (MKL) vs oneDNN's linear (kernels/cpu_gemm.py), per shape.

Shapes are SmolLM2-135M's projections (hidden 576, intermediate 1536, fused qkv 960, gate_up 3072) at
prefill-sized row counts, plus a few-row case for reference. Prints GFLOP/s per path, median of
--repeats calls after one warm-up call, on --num-threads torch threads.

    PYTHONPATH=src python benchmarks/cpu_gemm.py --num-threads 2
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from conveyor.kernels.cpu_gemm import onednn_available, prefill_linear

SHAPES = [(2048, 960, 576), (2048, 576, 576), (2048, 3072, 576), (2048, 576, 1536), (512, 3072, 576),
          (64, 3072, 576), (8, 3072, 576)]
"""(rows, out, in)."""


def median_s(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    print(f"cpu: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{args.num_threads} thread(s), oneDNN available: {onednn_available()}")
    for rows, n, k in SHAPES:
        x, w = torch.randn(rows, k), torch.randn(n, k)
        flops = 2 * rows * n * k / 1e9
        mkl = flops / median_s(lambda: F.linear(x, w), args.repeats)
        dnn = flops / median_s(lambda: prefill_linear(x, w), args.repeats)
        print("GEMM " + json.dumps({"rows": rows, "out": n, "in": k, "mkl_gflop_s": round(mkl, 1),
                                    "onednn_gflop_s": round(dnn, 1), "speedup": round(dnn / mkl, 2)}))


if __name__ == "__main__":
    main()
