"""Conveyor's paged attention against vLLM's FlashAttention 3 on the same inputs, at the online shapes.

Issue 38's H100 bf16 online pair left conveyor's median TPOT 13% over vLLM's at 16 req/s and its median
ITL 5% over (docs/performance.md, "Issue 37's same-machine pair, and both online tables"); vLLM served
with FA3 (its log: "Using FlashAttention version 3"). This times both kernels on one batch each, so the
attention's share of that gap is measured rather than guessed. The cases are what `vllm bench serve`'s
random dataset (1,024 +- 50% input, 256 +- 50% output tokens) puts in a step at 16-24 req/s, Llama-3.1-8B's
heads (32 query, 8 KV, d 128), block size 16, bf16:
- decode batches of 64, 96 and 256 running requests, contexts uniform in [600, 1,900];
- a mixed step: 70 decodes and one new 1,050-token prompt (the step that stalls every running request);
- prefill alone: one 1,050-token prompt, and eight 1,024-token prompts (8,192 tokens, the token budget).
FA3 is called as vLLM's FlashAttentionImpl calls it (paged K/V through `block_table`, `seqused_k`, causal,
its own split heuristic; no AOT scheduler metadata). Each row: both times (median of triton's do_bench),
the ratio, and the largest difference between the two outputs (a wrong comparison shows there first).

    PYTHONPATH=$PWD/src:/tmp/site python3 benchmarks/gpu/attn_vs_fa3.py      # on the GPU, vLLM's site unpacked
    python3 benchmarks/gpu/attn_vs_fa3.py --list                            # the cases, no GPU needed
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass

HEADS = (32, 8)
"""Llama-3.1-8B: query heads, KV heads."""
SCALE = 128**-0.5


@dataclass(frozen=True)
class Case:
    name: str
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    """Context length of each sequence after this step (its query tokens included)."""


def online_cases(seed: int = 0) -> list[Case]:
    rng = random.Random(seed)

    def contexts(n: int) -> tuple[int, ...]:
        return tuple(rng.randint(600, 1900) for _ in range(n))

    cases = [Case(f"decode {n}", (1,) * n, contexts(n)) for n in (64, 96, 256)]
    cases.append(Case("mixed 70 decodes + 1,050-token prompt", (1,) * 70 + (1050,), contexts(70) + (1050,)))
    cases.append(Case("prefill 1 x 1,050", (1050,), (1050,)))
    cases.append(Case("prefill 8 x 1,024", (1024,) * 8, (1024,) * 8))
    return cases


def fa3_call(query, caches, batch):
    """vLLM's FA3 over conveyor's inputs: the caches' layout [nb, bs, kvh, d] is the one FA3 pages."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    def run():
        return flash_attn_varlen_func(q=query, k=caches[0], v=caches[1], max_seqlen_q=batch.max_query_len,
                                      cu_seqlens_q=batch.query_start_loc, max_seqlen_k=batch.max_seq_len,
                                      seqused_k=batch.seq_lens, softmax_scale=SCALE, causal=True,
                                      block_table=batch.block_tables, fa_version=3)
    return run


def measure(case: Case) -> dict:
    import torch
    from kernels import (  # benchmarks/gpu/kernels.py, beside this script
        attention_cost,
        make_batch,
        time_ms,
    )

    from conveyor.kernels.unified_attention import unified_attention

    query, caches, batch = make_batch(list(case.query_lens), list(case.seq_lens), HEADS)
    ours = lambda: unified_attention(query, caches[0], caches[1], batch, SCALE)
    theirs = fa3_call(query, caches, batch)
    diff = (ours().float() - theirs().float()).abs().max().item()
    conveyor_ms, fa3_ms = time_ms(ours), time_ms(theirs)
    nbytes, flops = attention_cost(list(case.query_lens), list(case.seq_lens), HEADS)
    torch.cuda.synchronize()
    return {"case": case.name, "conveyor_ms": round(conveyor_ms, 4), "fa3_ms": round(fa3_ms, 4),
            "conveyor_over_fa3": round(conveyor_ms / fa3_ms, 3), "max_abs_diff": diff,
            "conveyor_GB_s": round(nbytes / conveyor_ms / 1e6, 1), "fa3_GB_s": round(nbytes / fa3_ms / 1e6, 1),
            "conveyor_TFLOP_s": round(flops / conveyor_ms / 1e9, 1), "fa3_TFLOP_s": round(flops / fa3_ms / 1e9, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print the cases and exit (no GPU needed)")
    args = parser.parse_args(argv)
    cases = online_cases()
    if args.list:
        for case in cases:
            print(f"{case.name}: {len(case.query_lens)} sequences, {sum(case.query_lens)} query tokens, "
                  f"{sum(case.seq_lens)} context tokens")
        return 0
    import torch

    torch.manual_seed(0)
    for case in cases:
        print("ATTN " + json.dumps(measure(case)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
