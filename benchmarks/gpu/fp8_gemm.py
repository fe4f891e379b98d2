#!/usr/bin/env python3
"""FP8 and bf16 projections on the GPU: cuBLAS / `_scaled_mm` against kernels/triton_gemm.py (issues 37, 38).

For Llama-3.1-8B's four projection shapes at decode and prefill row counts, times one projection as
the engine runs it (inside a CUDA graph, so launch latency counts as it does under graphs, host
overhead does not): bf16 `x @ W^T`; `fp8_linear` (per-tensor: zeroed max, amax pass, cast pass, tensor-wise
`_scaled_mm`); `fp8_linear_per_token` (one quantization launch, row-wise `_scaled_mm`); then the Triton
GEMM at its M bucket's config: bf16 (`triton_bf16_us`), FP8 with the same quantization (`triton_fp8_us`,
against `per_tensor_us`), and the two FP8 GEMMs alone on an already quantized x (`triton_fp8_gemm_us`
against `scaled_mm_us`). Prints one JSON line per shape ("FP8GEMM {...}") and the per-step sum at each
row count (32 layers x 4 projections). `--configs` also times every candidate tile of `candidate_configs`
per shape and element type ("GEMMCFG {...}" lines, the fastest first): the offline sweep behind
triton_gemm.py's M buckets (the engine never autotunes: it would benchmark inside a graph capture).

    PYTHONPATH=src python benchmarks/gpu/fp8_gemm.py [--rows 1 64 256 1024 16384] [--configs]
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
from conveyor.kernels.fp8_quant import quantize_fp8_dynamic
from conveyor.kernels.triton_gemm import GemmConfig, pick_config, triton_fp8_gemm, triton_fp8_linear, triton_gemm

LLAMA_8B = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
QWEN3_06B = {"qkv": (1024, 4096), "o": (2048, 1024), "gate_up": (1024, 6144), "down": (3072, 1024)}
"""Qwen3-0.6B: hidden 1024, 16 query / 8 KV heads of 128, intermediate 3072. Its 112 projections ran at
~8 us each in a batch-256 decode step (0.82 ms for ~0.88 GB of weights, ~36% of HBM bandwidth): the
shape where a decode GEMM has the most to win (docs/performance.md, lever 5's profile)."""
MODELS = {"llama-3.1-8b": (LLAMA_8B, 32), "qwen3-0.6b": (QWEN3_06B, 28)}
"""--model -> (projection shapes, layers)."""
"""Projection (K, N) of Llama-3.1-8B: hidden 4096, 32 query / 8 KV heads of 128, intermediate 14336."""
REPEATS = 10
DEVICE = "cuda"
"""Where the operands live (a CPU dry run under Triton's interpreter sets "cpu" and replaces `graph_ms`)."""
COLUMNS = ("bf16_us", "per_tensor_us", "per_token_us", "triton_bf16_us", "triton_fp8_us", "scaled_mm_us",
           "triton_fp8_gemm_us")


def graph_ms(fn) -> float:
    """Median ms of one `fn()` call, replayed REPEATS times inside one CUDA graph."""
    fn()  # compile and warm outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPEATS):
            fn()
    return triton.testing.do_bench(graph.replay, warmup=10, rep=100, return_mode="median") / REPEATS


def describe(config: GemmConfig) -> str:
    return f"{config.block_m}x{config.block_n}x{config.block_k} w{config.num_warps} s{config.num_stages}"


def candidate_configs(rows: int, fp8: bool) -> list[GemmConfig]:
    """The tiles `--configs` sweeps at `rows`: M tiles up to the rows' power of two (16-128), N tiles 32-128,
    a K step of 128 or 256 bytes, 4 or 8 warps, 3-5 stages, and the M bucket's own config."""
    width = 1 if fp8 else 2
    block_ms = [m for m in (16, 32, 64, 128) if m <= max(16, triton.next_power_of_2(rows))]
    shapes = [(32, 256, 4, 4), (32, 128, 4, 5), (64, 128, 4, 5), (64, 256, 4, 4), (128, 128, 4, 4), (128, 128, 8, 3)]
    swept = [GemmConfig(m, n, k_bytes // width, num_warps=warps, num_stages=stages)
             for m in block_ms for n, k_bytes, warps, stages in shapes]
    bucket = pick_config(rows, fp8)  # the engine's own choice is always among them
    return swept if bucket in swept else [bucket, *swept]


def operands(rows: int, k: int, n: int) -> tuple[torch.Tensor, ...]:
    """x [rows, K] bf16, W [N, K] bf16, W_q [N, K] e4m3 and its scale, x_q [rows, K] e4m3 and its scale."""
    x = torch.randn(rows, k, device=DEVICE, dtype=torch.bfloat16)
    weight = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) * 0.02
    return (x, weight, *quantize_weight_fp8(weight), *quantize_fp8_dynamic(x))


def time_shape(rows: int, name: str, k: int, n: int) -> dict:
    x, weight, weight_q, weight_scale, x_q, x_scale = operands(rows, k, n)
    weight_row = per_token_weight_scales(weight_scale, n)  # once per weight, as a module would hold it
    row = {"rows": rows, "proj": name, "K": k, "N": n,
           "bf16_us": graph_ms(lambda: x @ weight.t()) * 1e3,
           "per_tensor_us": graph_ms(lambda: fp8_linear(x, weight_q, weight_scale)) * 1e3,
           "per_token_us": graph_ms(lambda: fp8_linear_per_token(x, weight_q, weight_row)) * 1e3,
           "triton_bf16_us": graph_ms(lambda: triton_gemm(x, weight)) * 1e3,
           "triton_fp8_us": graph_ms(lambda: triton_fp8_linear(x, weight_q, weight_scale)) * 1e3,
           "scaled_mm_us": graph_ms(lambda: torch._scaled_mm(x_q, weight_q.t(), scale_a=x_scale, scale_b=weight_scale,
                                                             out_dtype=torch.bfloat16)) * 1e3,
           "triton_fp8_gemm_us": graph_ms(lambda: triton_fp8_gemm(x_q, weight_q, x_scale, weight_scale)) * 1e3,
           "triton_bf16_config": describe(pick_config(rows, fp8=False)),
           "triton_fp8_config": describe(pick_config(rows, fp8=True)),
           "weight_bytes_bf16": n * k * 2}
    row = {key: round(value, 2) if isinstance(value, float) else value for key, value in row.items()}
    print("FP8GEMM " + json.dumps(row), flush=True)
    return row


def sweep_shape(rows: int, name: str, k: int, n: int) -> None:
    """Times every candidate config of both element types at one shape: one GEMMCFG line each, fastest first."""
    x, weight, weight_q, weight_scale, x_q, x_scale = operands(rows, k, n)
    for fp8 in (False, True):
        timed = []
        for config in candidate_configs(rows, fp8):
            fn = ((lambda c=config: triton_fp8_gemm(x_q, weight_q, x_scale, weight_scale, config=c)) if fp8
                  else (lambda c=config: triton_gemm(x, weight, config=c)))
            try:
                timed.append((graph_ms(fn) * 1e3, describe(config)))
            except Exception as error:  # a tile that does not fit shared memory: say so, go on
                print(f"GEMMCFG-SKIP {name} rows={rows} fp8={fp8} {describe(config)}: {type(error).__name__}")
        for rank, (us, config_name) in enumerate(sorted(timed)):
            print("GEMMCFG " + json.dumps({"rows": rows, "proj": name, "fp8": fp8, "rank": rank, "config": config_name,
                                           "us": round(us, 2), "bucket": describe(pick_config(rows, fp8))}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256, 1024, 16384])
    parser.add_argument("--configs", action="store_true", help="also sweep triton_gemm's candidate tiles per shape")
    parser.add_argument("--model", choices=sorted(MODELS), default="llama-3.1-8b", help="whose projection shapes")
    args = parser.parse_args()
    shapes_of, layers = MODELS[args.model]
    print(f"{'rows':>6} " + " ".join(f"{key[:-3]:>18}" for key in COLUMNS)
          + f"   (ms/step: {args.model}, {layers} layers x 4 projections)")
    for rows in args.rows:
        shapes = [time_shape(rows, name, k, n) for name, (k, n) in shapes_of.items()]
        total = {key: sum(s[key] for s in shapes) * layers / 1e3 for key in COLUMNS}
        print(f"{rows:>6} " + " ".join(f"{total[key]:>18.3f}" for key in COLUMNS), flush=True)
    for rows in args.rows if args.configs else []:
        for name, (k, n) in shapes_of.items():
            sweep_shape(rows, name, k, n)


if __name__ == "__main__":
    main()
