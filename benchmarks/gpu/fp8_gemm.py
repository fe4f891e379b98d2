#!/usr/bin/env python3
"""FP8 projections on the GPU, per-tensor against per-token activation scales (issue 37's lever 4).

For Llama-3.1-8B's four projection shapes at decode and prefill row counts, times one projection as
the engine runs it (inside a CUDA graph, so launch latency counts as it does under graphs, host
overhead does not): bf16 `x @ W^T`; `fp8_linear` (per-tensor: zeroed max, amax pass, cast pass, tensor-wise
`_scaled_mm`); `fp8_linear_per_token` (one quantization launch, row-wise `_scaled_mm`). Prints one JSON
line per shape ("FP8GEMM {...}") and the per-step sum at each row count (32 layers x 4 projections).

    PYTHONPATH=src python benchmarks/gpu/fp8_gemm.py [--rows 1 64 256 1024 16384]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from conveyor.kernels.fp8_linear import (
    fp8_linear,
    fp8_linear_per_token,
    per_token_weight_scales,
    quantize_weight_fp8,
)

LLAMA_8B = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
"""Projection (K, N) of Llama-3.1-8B: hidden 4096, 32 query / 8 KV heads of 128, intermediate 14336."""
REPEATS = 10


def graph_ms(fn) -> float:
    """Median ms of one `fn()` call, replayed REPEATS times inside one CUDA graph."""
    fn()  # compile and warm outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPEATS):
            fn()
    return triton.testing.do_bench(graph.replay, warmup=10, rep=100, return_mode="median") / REPEATS


def time_shape(rows: int, name: str, k: int, n: int) -> dict:
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    weight_q, weight_scale = quantize_weight_fp8(weight)
    weight_row = per_token_weight_scales(weight_scale, n)  # once per weight, as a module would hold it
    row = {"rows": rows, "proj": name, "K": k, "N": n,
           "bf16_us": graph_ms(lambda: x @ weight.t()) * 1e3,
           "per_tensor_us": graph_ms(lambda: fp8_linear(x, weight_q, weight_scale)) * 1e3,
           "per_token_us": graph_ms(lambda: fp8_linear_per_token(x, weight_q, weight_row)) * 1e3}
    row = {key: round(value, 2) if isinstance(value, float) else value for key, value in row.items()}
    print("FP8GEMM " + json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256, 1024, 16384])
    args = parser.parse_args()
    print(f"{'rows':>6} {'bf16 ms/step':>13} {'per-tensor':>11} {'per-token':>10}   (32 layers x 4 projections)")
    for rows in args.rows:
        shapes = [time_shape(rows, name, k, n) for name, (k, n) in LLAMA_8B.items()]
        total = {key: sum(s[key] for s in shapes) * 32 / 1e3 for key in ("bf16_us", "per_tensor_us", "per_token_us")}
        print(f"{rows:>6} {total['bf16_us']:>13.3f} {total['per_tensor_us']:>11.3f} {total['per_token_us']:>10.3f}")


if __name__ == "__main__":
    main()
