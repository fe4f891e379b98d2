#!/usr/bin/env python3
"""The small per-layer Triton kernels at decode sizes: qk_norm_rope_, rotary_ and store_kv, per call.

Qwen3-0.6B's q/k norm + rope (16 q and 8 kv heads of 128) and Llama-3.1-8B's rotary (32 and 8 heads of
128) on q and k as strided views of a fused qkv output [T, (H + 2 kvh) d], cos/sin [T, d], bf16; store_kv
of both models' K/V (the same 8 x 128 shape: the two lines double as a repeat) into a bf16 paged cache
of 16-token blocks at distinct random slots. For each T of --tokens, one JSON line ("SMALL {...}"): the
median µs of one call (triton.testing.do_bench, eager: launch latency included) and, unless --no-graph,
of one call replayed REPEATS times in a CUDA graph, as the engine replays decode steps (`graph_us`); the
bytes the call must move (q and k read and written, cos/sin and weights read; K/V read and written, the
slots read) and the GB/s that makes. do_bench flushes L2 before each timed call, so the eager figure is
cold; in a graph only the first of the REPEATS calls is.

For a before/after run it on two trees on the same GPU (2026-12-07: a program per (token, head row)
for qk_norm_rope_ before; a program per token, all of a token's loads before any store, after):

    PYTHONPATH=src python benchmarks/gpu/small_kernels.py [--tokens 1 55 256 1024] [--no-graph]
    PYTHONPATH=/path/to/before/src python benchmarks/gpu/small_kernels.py   # this script, the old kernels

(it calls only the kernels' public wrappers, whose signatures the two trees share).

Prediction, µs a call in the graph on an H100, before -> after (the eager figure ~2-4 µs more; the
profile's before: qk_norm_rope_ 5.3 at T=256, rotary_ 5.4 and store_kv 2.6 at T=55):
  qk_norm_rope_ (qwen3-0.6b)  T=1 2.5 -> 2.5,  T=55 3.5 -> 2.5,  T=256 5.3 -> 3.0,  T=1024 15 -> 7
  rotary_ (llama-3.1-8b)      T=1 2.5 -> 2.3,  T=55 5.4 -> 3.0,  T=256 8 -> 4.5,    T=1024 16 -> 10
  store_kv (either)           T=1 2.3 -> 2.0,  T=55 2.6 -> 2.2,  T=256 3.5 -> 3.0,  T=1024 6 -> 5.5
i.e. qk_norm_rope_ from ~0.6 to ~1.0 TB/s at T=256 (a launch's ~2 µs floor dominates at these sizes)
and to ~1.8 TB/s at T=1024; store_kv gains only the slot's round trip. Why, from the PTX of both trees
compiled for sm_90 on a CPU (Triton 3.9; tests/kernels/test_small_kernels_sm90.py holds the after):
the old qk_norm_rope_ program made 2-byte scalar accesses (one element a thread, cos/sin per row);
the old rotary_ issued k's loads after q's stores (two round trips a program); the old store_kv
loaded K/V only after branching on the slot. After, each issues all of its loads, in 16-byte vectors,
before its first store.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from conveyor.kernels.qk_norm_rope import qk_norm_rope_
from conveyor.kernels.rotary import rotary_
from conveyor.kernels.store_kv import store_kv
from conveyor.kernels.triton_compat import HAS_TRITON

REPEATS = 20
"""Calls captured in one CUDA graph; graph_us is one replay's time over REPEATS."""
BLOCK_SIZE = 16
BF16 = 2  # bytes an element


@dataclass(frozen=True)
class Heads:
    model: str
    q_heads: int
    kv_heads: int
    head_dim: int


QWEN3_06B = Heads("qwen3-0.6b", 16, 8, 128)
LLAMA_8B = Heads("llama-3.1-8b", 32, 8, 128)


@dataclass(frozen=True)
class Case:
    kernel: str  # "qk_norm_rope_", "rotary_" or "store_kv"
    heads: Heads
    tokens: int

    def bytes_moved(self) -> int:
        """What one call must read and write at least (bf16 elements, int64 slots)."""
        h, t = self.heads, self.tokens
        if self.kernel == "store_kv":
            return 2 * 2 * t * h.kv_heads * h.head_dim * BF16 + 8 * t  # K and V read and written; slots
        rows = 2 * t * (h.q_heads + h.kv_heads) * h.head_dim * BF16  # q and k read and written
        weights = 2 * h.head_dim * BF16 if self.kernel == "qk_norm_rope_" else 0
        return rows + 2 * t * h.head_dim * BF16 + weights  # + cos/sin [T, d]


def cases(tokens: list[int]) -> list[Case]:
    """qk_norm_rope_ at Qwen3-0.6B's heads, rotary_ at Llama-3.1-8B's, store_kv at both, for every T."""
    kinds = [("qk_norm_rope_", QWEN3_06B), ("rotary_", LLAMA_8B), ("store_kv", QWEN3_06B), ("store_kv", LLAMA_8B)]
    return [Case(kernel, heads, t) for kernel, heads in kinds for t in tokens]


def make_call(case: Case, device: torch.device, seed: int = 0) -> Callable[[], None]:
    """The case's inputs, built once, and a closure that runs the kernel on them (in place)."""
    h, t = case.heads, case.tokens
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (h.q_heads + 2 * h.kv_heads) * h.head_dim, generator=gen).bfloat16().to(device)
    q = qkv[:, : h.q_heads * h.head_dim].view(t, h.q_heads, h.head_dim)  # [T, H, d]
    k = qkv[:, h.q_heads * h.head_dim : (h.q_heads + h.kv_heads) * h.head_dim].view(t, h.kv_heads, h.head_dim)
    v = qkv[:, (h.q_heads + h.kv_heads) * h.head_dim :].view(t, h.kv_heads, h.head_dim)  # [T, kvh, d]
    if case.kernel == "store_kv":
        num_blocks = -(-2 * t // BLOCK_SIZE) + 1  # half the slots taken, as a busy cache
        caches = torch.zeros(2, num_blocks, BLOCK_SIZE, h.kv_heads, h.head_dim, dtype=torch.bfloat16, device=device)
        slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:t].to(device)  # int64 [T], distinct
        return lambda: store_kv(k, v, caches[0], caches[1], slots)
    angles = torch.rand(t, h.head_dim // 2, generator=gen) * 100
    cos = torch.cat([angles.cos()] * 2, -1).bfloat16().to(device)  # [T, d]
    sin = torch.cat([angles.sin()] * 2, -1).bfloat16().to(device)
    if case.kernel == "rotary_":
        return lambda: rotary_(q, k, cos, sin)
    weights = (1 + 0.1 * torch.randn(2, h.head_dim, generator=gen)).bfloat16().to(device)  # [2, d]
    return lambda: qk_norm_rope_(q, k, weights[0], weights[1], cos, sin, 1e-6)


def time_us(fn: Callable[[], None], graph: bool) -> float:
    """Median µs of one call: do_bench on the call, or on a graph of REPEATS calls over REPEATS."""
    do_bench = importlib.import_module("triton.testing").do_bench  # here: the script imports without Triton
    fn()  # compile outside any capture
    torch.cuda.synchronize()
    if not graph:
        return 1e3 * float(do_bench(fn, warmup=25, rep=200, return_mode="median"))
    captured = torch.cuda.CUDAGraph()
    with torch.cuda.graph(captured):
        for _ in range(REPEATS):
            fn()
    return 1e3 * float(do_bench(captured.replay, warmup=10, rep=200, return_mode="median")) / REPEATS


def measure(case: Case, graph: bool) -> dict[str, object]:
    """One case on the GPU -> its JSON row."""
    fn = make_call(case, torch.device("cuda"))
    row: dict[str, object] = {"kernel": case.kernel, "model": case.heads.model, "tokens": case.tokens,
                              "bytes": case.bytes_moved()}
    for key, in_graph in (("us", False), ("graph_us", True)):
        if in_graph and not graph:
            continue
        us = time_us(fn, in_graph)
        row[key], row[key.replace("us", "gb_s")] = round(us, 2), round(case.bytes_moved() / us / 1e3, 1)
    return row


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 55, 256, 1024], help="tokens T per call")
    parser.add_argument("--no-graph", action="store_true", help="eager timings only (no CUDA graph capture)")
    args = parser.parse_args(argv)
    if min(args.tokens) < 1:
        parser.error("--tokens must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not (HAS_TRITON and torch.cuda.is_available()):
        print("small_kernels.py times Triton kernels on a CUDA GPU: this machine has "
              f"{'no CUDA device' if HAS_TRITON else 'no Triton'}; run it on the GPU", file=sys.stderr)
        return 2
    print(json.dumps({"device": torch.cuda.get_device_name(0), "repeats_in_graph": REPEATS}))
    for case in cases(args.tokens):
        print("SMALL " + json.dumps(measure(case, graph=not args.no_graph)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
