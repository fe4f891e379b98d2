#!/usr/bin/env python3
"""Microbenchmarks of conveyor's attention kernels on the GPU: achieved bandwidth / FLOP rate per case.

Cases are the shapes nano256 produces (Qwen3-0.6B: 16 query / 8 KV heads; Llama-3.1-8B: 32 / 8; d=128):
decode batches of 256 sequences with contexts uniform in [100, 2048], decode with few long sequences
(unified vs split-KV), pure prefill chunks, and a mixed batch. Decode is judged by bytes (K and V of every
context token read once) over time, prefill by causal attention FLOPs over time. Also sweeps the unified
kernel's tile shape. Prints one JSON line per case ("KERNEL {...}") and a table. `--kv-dtype fp8` stores the
caches in e4m3 (bytes counted at one per element); `--decode-only` runs the decode cases and their sweep.

    python benchmarks/gpu/kernels.py [--quick] [--decode-only | --mixed-only] [--order] [--kv-dtype bf16|fp8]
"""

from __future__ import annotations

import argparse
import json
import math
import random

import torch
import triton

from conveyor.kernels.paged_batch import PagedBatch
from conveyor.kernels.split_kv_attention import SplitKVParams, choose_num_splits, split_kv_attention
from conveyor.kernels.store_kv import store_kv
from conveyor.kernels.unified_attention import (
    UnifiedTile,
    unified_attention,
    unified_attention_with_tile,
    unified_tile,
)

BLOCK_SIZE = 16
HEAD_DIM = 128
KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def make_batch(query_lens: list[int], seq_lens: list[int], heads: tuple[int, int],
               kv_dtype: torch.dtype = torch.bfloat16) -> tuple:
    """Random bf16 query, caches in kv_dtype, shuffled block tables (no reference: speed only)."""
    num_heads, num_kv_heads = heads
    blocks = [math.ceil(n / BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(blocks)
    perm = torch.randperm(num_blocks, device="cuda", dtype=torch.int64).to(torch.int32)
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device="cuda")
    tail = 0
    for seq, count in enumerate(blocks):
        table[seq, :count] = perm[tail : tail + count]
        tail += count
    caches = torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM, device="cuda").to(kv_dtype)
    starts = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    query = torch.randn(int(starts[-1]), num_heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    batch = PagedBatch(table, torch.tensor(seq_lens, dtype=torch.int32, device="cuda"), starts.cuda(),
                       max(query_lens), max(seq_lens))
    return query, caches, batch


def attention_cost(query_lens: list[int], seq_lens: list[int], heads: tuple[int, int],
                   kv_element_bytes: int = 2) -> tuple[float, float]:
    """(bytes: K+V of every context token once + q + out, FLOPs: 4 * visible (q, k) pairs * H * d)."""
    num_heads, num_kv_heads = heads
    kv_bytes = sum(seq_lens) * num_kv_heads * HEAD_DIM * 2 * kv_element_bytes
    qo_bytes = sum(query_lens) * num_heads * HEAD_DIM * 2 * 2
    pairs = sum(q * (s - q) + q * (q + 1) / 2 for q, s in zip(query_lens, seq_lens))
    return kv_bytes + qo_bytes, 4.0 * pairs * num_heads * HEAD_DIM


def time_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def report(name: str, ms: float, cost: tuple[float, float], extra: dict | None = None) -> dict:
    row = {"case": name, "ms": round(ms, 4), "GB_s": round(cost[0] / ms / 1e6, 1),
           "TFLOP_s": round(cost[1] / ms / 1e9, 2), **(extra or {})}
    print("KERNEL " + json.dumps(row), flush=True)
    return row


def decode_cases(rows: list[dict], quick: bool, kv_dtype: torch.dtype) -> None:
    rng = random.Random(0)
    for model, heads in (("qwen3-0.6b", (16, 8)), ("llama-3.1-8b", (32, 8))):
        for num_seqs in ((256,) if quick else (64, 256, 512)):
            seq_lens = [rng.randint(100, 2048) for _ in range(num_seqs)]
            query, caches, batch = make_batch([1] * num_seqs, seq_lens, heads, kv_dtype)
            cost = attention_cost([1] * num_seqs, seq_lens, heads, caches.element_size())
            ms = time_ms(lambda: unified_attention(query, caches[0], caches[1], batch, 0.088))
            rows.append(report(f"decode {model} S={num_seqs} kv={caches.dtype}", ms, cost))
            if num_seqs == 256:
                sweep_decode(rows, (query, caches, batch), cost, heads)


def sweep_decode(rows: list[dict], inputs: tuple, cost: tuple, heads: tuple[int, int]) -> None:
    query, caches, batch = inputs
    group_pad = triton.next_power_of_2(heads[0] // heads[1])
    tiles = [(32, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 2), (64, 2, 2), (128, 4, 3)]
    if caches.element_size() == 1:  # FP8: a 128-key tile holds the bytes of a 16-bit 64-key tile
        tiles += [(64, 4, 2), (64, 4, 4), (128, 4, 4), (128, 8, 3), (256, 4, 2), (256, 8, 2), (256, 8, 3)]
    for tile_n, warps, stages in tiles:
        tile = UnifiedTile(16 // group_pad, 16, tile_n, warps, stages)
        ms = time_ms(lambda: unified_attention_with_tile(query, (caches[0], caches[1]), batch, 0.088, tile))
        rows.append(report(f"  sweep decode tile_n={tile_n} warps={warps} stages={stages}", ms, cost))


def long_context_cases(rows: list[dict]) -> None:
    heads = (32, 8)
    for num_seqs, ctx in ((1, 4096), (4, 8192), (16, 4096), (32, 2048)):
        query, caches, batch = make_batch([1] * num_seqs, [ctx] * num_seqs, heads)
        cost = attention_cost([1] * num_seqs, [ctx] * num_seqs, heads)
        ms = time_ms(lambda: unified_attention(query, caches[0], caches[1], batch, 0.088))
        rows.append(report(f"long S={num_seqs} ctx={ctx} unified", ms, cost))
        splits = choose_num_splits(num_seqs, heads[1], ctx, torch.cuda.get_device_properties(0).multi_processor_count)
        params = SplitKVParams(0.088, splits)
        ms = time_ms(lambda: split_kv_attention(query, caches[0], caches[1], batch, params))
        rows.append(report(f"long S={num_seqs} ctx={ctx} split={splits}", ms, cost))


def prefill_cases(rows: list[dict]) -> None:
    for model, heads in (("qwen3-0.6b", (16, 8)), ("llama-3.1-8b", (32, 8))):
        for query_lens, ctx in (([1024] * 16, 0), ([2048] * 8, 0), ([512] * 8, 1536)):
            seq_lens = [q + ctx for q in query_lens]
            query, caches, batch = make_batch(query_lens, seq_lens, heads)
            cost = attention_cost(query_lens, seq_lens, heads)
            ms = time_ms(lambda: unified_attention(query, caches[0], caches[1], batch, 0.088))
            rows.append(report(f"prefill {model} {len(query_lens)}x{query_lens[0]} ctx={ctx}", ms, cost))
            if query_lens[0] == 1024:
                sweep_prefill(rows, (query, caches, batch), cost, heads)
        sdpa_row(rows, heads)


def sweep_prefill(rows: list[dict], inputs: tuple, cost: tuple, heads: tuple[int, int]) -> None:
    query, caches, batch = inputs
    group_pad = triton.next_power_of_2(heads[0] // heads[1])
    for block_m, tile_n, warps, stages in [(64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 4, 2), (64, 32, 4, 2),
                                           (128, 32, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (64, 128, 4, 2)]:
        tile = UnifiedTile(block_m // group_pad, block_m, tile_n, warps, stages)
        ms = time_ms(lambda: unified_attention_with_tile(query, (caches[0], caches[1]), batch, 0.088, tile))
        rows.append(report(f"  sweep prefill M={block_m} N={tile_n} w={warps} s={stages}", ms, cost))


def sdpa_row(rows: list[dict], heads: tuple[int, int]) -> None:
    """torch SDPA (flash) on 16 x 1024 dense causal: what a contiguous kernel reaches on this GPU."""
    q = torch.randn(16, heads[0], 1024, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(16, heads[1], 1024, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
    cost = attention_cost([1024] * 16, [1024] * 16, heads)
    rows.append(report(f"  torch sdpa dense 16x1024 heads={heads}", time_ms(fn), cost))


def mixed_and_store(rows: list[dict]) -> None:
    rng = random.Random(1)
    heads = (32, 8)
    query_lens = [1] * 240 + [2048]
    seq_lens = [rng.randint(100, 2048) for _ in range(240)] + [2048 + 500]
    query, caches, batch = make_batch(query_lens, seq_lens, heads)
    cost = attention_cost(query_lens, seq_lens, heads)
    ms = time_ms(lambda: unified_attention(query, caches[0], caches[1], batch, 0.088))
    rows.append(report("mixed 240 decodes + 2048-token chunk", ms, cost))
    one = unified_tile(2048, heads[0] // heads[1])  # before: every row in one launch of 64-row blocks
    ms = time_ms(lambda: unified_attention_with_tile(query, (caches[0], caches[1]), batch, 0.088, one))
    rows.append(report("  mixed, one launch of 64-row blocks", ms, cost))
    for name, part in (("decodes", slice(0, 240)), ("chunk", slice(240, 241))):
        q_lens, s_lens = query_lens[part], seq_lens[part]
        inputs = make_batch(q_lens, s_lens, heads)
        ms = time_ms(lambda: unified_attention(inputs[0], inputs[1][0], inputs[1][1], inputs[2], 0.088))
        rows.append(report(f"  mixed, its {name} alone", ms, attention_cost(q_lens, s_lens, heads)))
    kv = torch.randn(16384, 3 * 8, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    cache = torch.empty(2, 2048, BLOCK_SIZE, 8, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(2048 * BLOCK_SIZE, device="cuda")[:16384]
    ms = time_ms(lambda: store_kv(kv[:, 8:16], kv[:, 16:24], cache[0], cache[1], slots))
    rows.append(report("store_kv 16384 tokens kvh=8", ms, (16384 * 8 * HEAD_DIM * 2 * 2 * 2, 0.0)))


def decode_order_cases(rows: list[dict]) -> None:
    """One decode batch of 256 in three program orders: as drawn, longest first, shortest first. The GPU
    starts programs roughly in order, so longest first is the classic cure for a launch's tail."""
    rng = random.Random(0)
    drawn = [rng.randint(100, 2048) for _ in range(256)]
    for model, heads in (("qwen3-0.6b", (16, 8)), ("llama-3.1-8b", (32, 8))):
        for order, seq_lens in (("drawn", drawn), ("longest first", sorted(drawn, reverse=True)),
                                ("shortest first", sorted(drawn))):
            query, caches, batch = make_batch([1] * 256, seq_lens, heads)
            ms = time_ms(lambda: unified_attention(query, caches[0], caches[1], batch, 0.088))
            rows.append(report(f"decode order {model} S=256 {order}", ms, attention_cost([1] * 256, seq_lens, heads)))


def online_mixed(rows: list[dict]) -> None:
    """The online Llama-3.1-8B mixed step of mixed_profile.py: 55 decodes of ~1,516 keys and one 1,200-token
    chunk with no cached prefix; each launch alone, and the chunk's prefill tile swept."""
    heads = (32, 8)
    query_lens, seq_lens = [1] * 55 + [1200], [1516] * 55 + [1200]
    query, caches, batch = make_batch(query_lens, seq_lens, heads)
    ms = time_ms(lambda: unified_attention(query, caches[0], caches[1], batch, 0.088))
    rows.append(report("online mixed 55 decodes x 1516 + 1200-token chunk", ms,
                       attention_cost(query_lens, seq_lens, heads)))
    for name, part in (("decodes", slice(0, 55)), ("chunk", slice(55, 56))):
        q_lens, s_lens = query_lens[part], seq_lens[part]
        inputs = make_batch(q_lens, s_lens, heads)
        cost = attention_cost(q_lens, s_lens, heads)
        ms = time_ms(lambda: unified_attention(inputs[0], inputs[1][0], inputs[1][1], inputs[2], 0.088))
        rows.append(report(f"  online mixed, its {name} alone", ms, cost))
        if name == "chunk":
            sweep_prefill(rows, inputs, cost, heads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer cases")
    parser.add_argument("--decode-only", action="store_true", help="only the decode cases and their sweep")
    parser.add_argument("--mixed-only", action="store_true", help="only the online mixed step (mixed_profile.py's)")
    parser.add_argument("--order", action="store_true", help="also a decode batch in three program orders")
    parser.add_argument("--kv-dtype", choices=sorted(KV_DTYPES), default="bf16", help="the decode caches' dtype")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows: list[dict] = []
    if args.order:
        decode_order_cases(rows)
    if args.mixed_only:
        online_mixed(rows)
    else:
        decode_cases(rows, args.quick, KV_DTYPES[args.kv_dtype])
    if not (args.decode_only or args.mixed_only):
        online_mixed(rows)
        long_context_cases(rows)
        prefill_cases(rows)
        mixed_and_store(rows)
    print(f"\n{'case':58} {'ms':>9} {'GB/s':>8} {'TFLOP/s':>8}")
    for row in rows:
        print(f"{row['case']:58} {row['ms']:9.4f} {row['GB_s']:8.1f} {row['TFLOP_s']:8.2f}")


if __name__ == "__main__":
    main()
