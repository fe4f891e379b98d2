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
add_rms_norm. Not engine code: a prototype to decide whether the lever is worth building.

    PYTHONPATH=src python benchmarks/gpu/splitk_probe.py [--rows 256 128 64 16] [--model qwen3-0.6b]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics

import torch
import torch.nn.functional as F

from conveyor.kernels.add_rms_norm import add_rms_norm
from conveyor.kernels.rms_norm import inv_rms, row_launch, scale_row
from conveyor.kernels.silu_and_mul import silu_and_mul
from conveyor.kernels.triton_compat import tl, triton

MODELS = pathlib.Path(__file__).resolve().parents[1] / "models"
TILES = [(64, 64, 128, 4, 3), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (32, 64, 128, 4, 3), (64, 32, 128, 4, 4),
         (16, 64, 256, 4, 3), (32, 128, 128, 4, 3)]
SPLITS = [1, 2, 4, 8]


@triton.jit
def _splitk_kernel(a_ptr, w_ptr, p_ptr, M, N, K, stride_am, stride_wn, k_per_split, SILU: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # a [M, K] (SILU: [M, 2K] = [gate | up]), w [N, K], p [S, M, N] float32: p[s] = a[:, Ks] @ w[:, Ks]^T
    pid, split = tl.program_id(0), tl.program_id(1)
    num_n = tl.cdiv(N, BLOCK_N)
    rm = (pid // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (pid % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, k_per_split, BLOCK_K):
        rk = split * k_per_split + kk + tl.arange(0, BLOCK_K)
        mask_k = rk < K
        a_mask = mask_m[:, None] & mask_k[None, :]
        a_rows = a_ptr + rm[:, None].to(tl.int64) * stride_am + rk[None, :]
        a = tl.load(a_rows, mask=a_mask, other=0.0)  # [BM, BK]
        if SILU:
            up = tl.load(a_rows + K, mask=a_mask, other=0.0)
            g32 = a.to(tl.float32)
            act = (g32 / (1.0 + tl.exp(-g32))).to(up.dtype)
            a = (act.to(tl.float32) * up.to(tl.float32)).to(up.dtype)
        w = tl.load(w_ptr + rn[None, :].to(tl.int64) * stride_wn + rk[:, None],
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # [BK, BN]
        acc = tl.dot(a, w, acc)
    out = p_ptr + (split * M + rm[:, None]).to(tl.int64) * N + rn[None, :]
    tl.store(out, acc, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _reduce_add_rms_norm_kernel(p_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, num_splits, num_rows, num_cols,
                                eps, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    residual = tl.load(residual_ptr + token * num_cols + cols, mask=mask, other=0.0)
    x32 = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(num_splits):
        x32 += tl.load(p_ptr + (s * num_rows + token) * num_cols + cols, mask=mask, other=0.0)
    x = x32.to(residual.dtype)  # the projection's 16-bit output, as cuBLAS would round it
    total = (x.to(tl.float32) + residual.to(tl.float32)).to(residual.dtype)
    tl.store(sum_ptr + token * num_cols + cols, total, mask=mask)
    t32 = total.to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = scale_row(t32, inv_rms(t32, num_cols, eps), weight, residual.dtype).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + token * num_cols + cols, out, mask=mask)


def splitk_norm(a: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor, tile: tuple,
                splits: int, silu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new residual) of add_rms_norm(a @ w.T, residual) (silu: a = silu_and_mul(a) first)."""
    bm, bn, bk, warps, stages = tile
    m, n, k = a.shape[0], w.shape[0], w.shape[1]
    k_per_split = triton.cdiv(triton.cdiv(k, splits), bk) * bk
    partials = torch.empty(splits, m, n, dtype=torch.float32, device=a.device)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), triton.cdiv(k, k_per_split))
    _splitk_kernel[grid](a, w, partials, m, n, k, a.stride(0), w.stride(0), k_per_split, SILU=silu,
                         BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    out = torch.empty_like(residual)
    total = torch.empty_like(residual)
    block, num_warps = row_launch(n)
    _reduce_add_rms_norm_kernel[(m,)](partials, residual, norm_w, out, total, grid[1], m, n, 1e-6, BLOCK=block,
                                      num_warps=num_warps)
    return out, total


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
