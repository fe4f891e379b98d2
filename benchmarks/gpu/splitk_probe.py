#!/usr/bin/env python3
"""Probe for issue 38's next Qwen3 lever: do split-K GEMMs, reduced inside the next add_rms_norm, beat
cuBLAS on the two projections whose output is only `hidden` wide (o_proj, down_proj)?

Why: at batch 256 Qwen3-0.6B's o_proj (K 2,048 -> N 1,024) takes 6.7 µs and down_proj (3,072 -> 1,024)
8.5 µs in cuBLAS, for 4 and 6 MB of weights (~1.5-2 µs of bandwidth). With N = 1,024 a 128-wide tile grid
has 16-32 programs on 132 SMs, each walking all of K. Splitting K over S programs writes S float32
partial rows; the add_rms_norm that follows the projection in every decoder layer already reads the
row, so it can sum the partials instead (no extra launch). For down_proj the SwiGLU can be computed
while loading A (no silu_and_mul launch either).

Each composite is timed the way a decode step runs it: captured in a CUDA graph (20 copies back to back),
replayed, median of 5 timings. Baselines: `F.linear` + add_rms_norm; silu_and_mul + `F.linear` +
add_rms_norm. The kernels timed are the engine's (kernels/splitk_linear.py, add_rms_norm_partials): the
best tile and split per shape set `splitk_plan`'s table.

    PYTHONPATH=src python benchmarks/gpu/splitk_probe.py [--rows 256 128 64 16] [--model qwen3-0.6b]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics

import torch
import torch.nn.functional as F

from conveyor.kernels.add_rms_norm import add_rms_norm, add_rms_norm_partials
from conveyor.kernels.silu_and_mul import silu_and_mul
from conveyor.kernels.splitk_linear import SplitKPlan, splitk_linear
from conveyor.kernels.triton_compat import triton

MODELS = pathlib.Path(__file__).resolve().parents[1] / "models"
TILES = [(64, 64, 128, 4, 3), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (32, 64, 128, 4, 3), (64, 32, 128, 4, 4),
         (16, 64, 256, 4, 3), (32, 128, 128, 4, 3)]
SPLITS = [1, 2, 4, 8]


def splitk_norm(a: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor, tile: tuple,
                splits: int, silu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new residual) of add_rms_norm(a @ w.T, residual) (silu: a = silu_and_mul(a) first), by the
    engine's own kernels: kernels/splitk_linear.py's partials, summed by add_rms_norm_partials."""
    bm, bn, bk, warps, stages = tile
    plan = SplitKPlan(bm, bn, bk, num_warps=warps, num_stages=stages, splits=splits)
    return add_rms_norm_partials(splitk_linear(a, w, silu, plan), residual, norm_w, 1e-6)


def graph_us(fn, copies: int = 20, replays: int = 20) -> float:
    """Per-call µs of fn inside a CUDA graph of `copies` calls, median of 5 timings."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(copies):
            fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (replays * copies))
    return statistics.median(times)


def probe(name: str, rows: int, k: int, n: int, silu: bool) -> dict:
    torch.manual_seed(0)
    a = torch.randn(rows, 2 * k if silu else k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    residual = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    norm_w = torch.rand(n, device="cuda", dtype=torch.bfloat16) + 0.5

    def base():
        x = silu_and_mul(a) if silu else a
        return add_rms_norm(F.linear(x, w), residual, norm_w, 1e-6)

    ref_out, ref_total = base()
    row = {"proj": name, "rows": rows, "K": k, "N": n, "silu": silu, "cublas_us": round(graph_us(base), 2)}
    best = None
    for tile in TILES:
        for splits in SPLITS:
            if triton.cdiv(k, splits) < tile[2]:
                continue
            out, total = splitk_norm(a, w, residual, norm_w, tile, splits, silu)
            err = (total.float() - ref_total.float()).abs().max().item()
            us = graph_us(lambda: splitk_norm(a, w, residual, norm_w, tile, splits, silu))
            if best is None or us < best[0]:
                best = (us, tile, splits, err)
    row.update(splitk_us=round(best[0], 2), tile="%dx%dx%d w%d s%d" % best[1], splits=best[2],
               max_abs_err_vs_cublas=best[3], speedup=round(row["cublas_us"] / best[0], 3))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[256, 128, 64, 16])
    parser.add_argument("--model", nargs="+", default=["qwen3-0.6b", "llama-3.1-8b"])
    args = parser.parse_args()
    print(torch.cuda.get_device_name(0), torch.__version__, triton.__version__)
    for model in args.model:
        cfg = json.loads((MODELS / model / "config.json").read_text())
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or hidden // heads
        for rows in args.rows:
            for name, k, silu in (("o", heads * head_dim, False), ("down", cfg["intermediate_size"], True)):
                print("SPLITK " + json.dumps({"model": model, **probe(name, rows, k, hidden, silu)}), flush=True)


if __name__ == "__main__":
    main()
