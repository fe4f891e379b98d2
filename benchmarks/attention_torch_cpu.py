"""Time the torch paged-attention backend on one SmolLM2-shaped layer (CPU), against that layer's matmuls.

A decode batch of `--num-seqs` sequences with contexts drawn uniformly from [30, 850] tokens (scattered
blocks), and one prefill chunk of 512 tokens after a 512-token cached prefix. The peer measured in the
same run is the layer's four projections (qkv, o, gate_up, down) for the same number of tokens: the
work a layer does besides attention. Median of `--repeats` timings, each the mean of 10 calls.

    PYTHONPATH=src python benchmarks/attention_torch_cpu.py --num-threads 1
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time
from collections.abc import Callable

import torch

from conveyor.model.attention import kv_cache_shape, paged_attention_torch
from conveyor.model.attention_metadata import AttentionMetadata, SequenceSpec, build_attention_metadata

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE, BLOCK = 9, 3, 64, 576, 1536, 16


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(10):
            fn()
        samples.append((time.perf_counter() - start) / 10 * 1e3)
    return statistics.median(samples)


def batch(specs: list[tuple[int, int]]) -> tuple[torch.Tensor, AttentionMetadata]:
    """(kv cache, metadata) for (num_query_tokens, seq_len) pairs over shuffled block ids."""
    counts = [-(-seq_len // BLOCK) for _, seq_len in specs]
    ids = list(range(1, sum(counts) + 1))
    random.shuffle(ids)
    seqs = []
    for (num_q, seq_len), count in zip(specs, counts):
        seqs.append(SequenceSpec(num_q, seq_len, ids[:count]))
        ids = ids[count:]
    kv_cache = torch.randn(kv_cache_shape(sum(counts) + 1, BLOCK, KV_HEADS, HEAD_DIM))
    return kv_cache, build_attention_metadata(seqs, BLOCK, "cpu")


def layer_matmuls(num_tokens: int) -> Callable[[], object]:
    x, mid = torch.randn(num_tokens, HIDDEN), torch.randn(num_tokens, INTERMEDIATE)
    qkv, out = torch.randn(HIDDEN + 2 * KV_HEADS * HEAD_DIM, HIDDEN), torch.randn(HIDDEN, HIDDEN)
    gate_up, down = torch.randn(2 * INTERMEDIATE, HIDDEN), torch.randn(HIDDEN, INTERMEDIATE)
    return lambda: (x @ qkv.T, x @ out.T, x @ gate_up.T, mid @ down.T)


def attention(kv_cache: torch.Tensor, metadata: AttentionMetadata) -> Callable[[], object]:
    query = torch.randn(metadata.num_tokens, HEADS, HEAD_DIM)

    def run() -> torch.Tensor:
        # A fresh metadata object per call, as a new step would bring (no cached plan).
        return paged_attention_torch(query, kv_cache, dataclasses.replace(metadata, backend_plan=None), 0.125)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--num-threads", type=int, default=None)
    args = parser.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    random.seed(0)
    torch.manual_seed(0)
    decodes = batch([(1, random.randint(30, 850)) for _ in range(args.num_seqs)])
    prefill = batch([(512, 1024)])
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(f"decode x{args.num_seqs}: attention {median_ms(attention(*decodes), args.repeats):.1f} ms, "
          f"matmuls {median_ms(layer_matmuls(args.num_seqs), args.repeats):.1f} ms per layer")
    print(f"prefill 512 after 512 cached: attention {median_ms(attention(*prefill), args.repeats):.1f} ms, "
          f"matmuls {median_ms(layer_matmuls(512), args.repeats):.1f} ms per layer")


if __name__ == "__main__":
    main()
