"""Time the CPU paged-attention backends on SmolLM2-shaped layers, against a layer's matmuls.

Decode batches: one sequence of 800 tokens, 8 of 800, and `--num-seqs` sequences with contexts drawn
uniformly from [30, 850] tokens (scattered blocks); and one prefill chunk of 512 tokens after a
512-token cached prefix. Each shape gets `--layers` separate KV caches, visited in turn as a step's
layers would be, so K/V come from memory rather than a warm cache. The backends (`--backends`, e.g.
the plain-torch gather + SDPA and the C in-place decode kernel) alternate within every repeat, so a
noisy moment on a shared machine hits them alike; times are this process's CPU time (see CLOCK). The peer is a layer's four float32 projections
(qkv, o, gate_up, down) for the same tokens. Per backend: median ms per layer [min-max of repeats].

    PYTHONPATH=src python benchmarks/attention_torch_cpu.py --num-threads 1 --backends torch cpu
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time
from collections.abc import Callable

import torch

from conveyor.model.attention import get_attention_backend, kv_cache_shape
from conveyor.model.attention_metadata import AttentionMetadata, SequenceSpec, build_attention_metadata

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE, BLOCK = 9, 3, 64, 576, 1536, 16
CLOCK = time.process_time
"""CPU seconds of this process: with one thread, time spent waiting for a core shared with other
jobs does not count (wall time on a loaded machine varied 3x between repeats; use --num-threads 1)."""


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    return statistics.median(alternate({"fn": fn}, repeats)["fn"])


def alternate(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """name -> per-repeat mean ms of 10 calls, the functions taking turns within each repeat."""
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = CLOCK()
            for _ in range(10):
                fn()
            samples[name].append((CLOCK() - start) / 10 * 1e3)
    return samples


def batch(specs: list[tuple[int, int]], num_layers: int) -> tuple[list[torch.Tensor], AttentionMetadata]:
    """(a kv cache per layer, metadata) for (num_query_tokens, seq_len) pairs over shuffled block ids."""
    counts = [-(-seq_len // BLOCK) for _, seq_len in specs]
    ids = list(range(1, sum(counts) + 1))
    random.shuffle(ids)
    seqs = []
    for (num_q, seq_len), count in zip(specs, counts):
        seqs.append(SequenceSpec(num_q, seq_len, ids[:count]))
        ids = ids[count:]
    kv_caches = [torch.randn(kv_cache_shape(sum(counts) + 1, BLOCK, KV_HEADS, HEAD_DIM)) for _ in range(num_layers)]
    return kv_caches, build_attention_metadata(seqs, BLOCK, "cpu")


def layer_matmuls(num_tokens: int) -> Callable[[], object]:
    x, mid = torch.randn(num_tokens, HIDDEN), torch.randn(num_tokens, INTERMEDIATE)
    qkv, out = torch.randn(HIDDEN + 2 * KV_HEADS * HEAD_DIM, HIDDEN), torch.randn(HIDDEN, HIDDEN)
    gate_up, down = torch.randn(2 * INTERMEDIATE, HIDDEN), torch.randn(HIDDEN, INTERMEDIATE)
    return lambda: (x @ qkv.T, x @ out.T, x @ gate_up.T, mid @ down.T)


def attention(backend_name: str, kv_caches: list[torch.Tensor], metadata: AttentionMetadata) -> Callable[[], object]:
    """One step's attention over every layer's cache; returns ms per layer via the caller's division."""
    query = torch.randn(metadata.num_tokens, HEADS, HEAD_DIM)
    backend = get_attention_backend(backend_name)

    def run() -> None:
        step = dataclasses.replace(metadata, backend_plan=None)  # a new step: planned by its first layer
        for kv_cache in kv_caches:
            backend.forward(query, kv_cache, step, 0.125)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--layers", type=int, default=8, help="separate KV caches per shape (cold K/V)")
    parser.add_argument("--backends", nargs="+", default=["torch", "cpu"])
    parser.add_argument("--num-threads", type=int, default=None)
    args = parser.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    random.seed(0)
    torch.manual_seed(0)
    shapes = {
        "decode 1 x 800": [(1, 800)],
        "decode 8 x 800": [(1, 800)] * 8,
        f"decode {args.num_seqs} x U[30, 850]": [(1, random.randint(30, 850)) for _ in range(args.num_seqs)],
        "prefill 512 after 512 cached": [(512, 1024)],
    }
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {args.layers} layers per shape")
    for label, specs in shapes.items():
        kv_caches, metadata = batch(specs, args.layers)
        samples = alternate({name: attention(name, kv_caches, metadata) for name in args.backends}, args.repeats)
        cells = [f"{name} {statistics.median(v) / args.layers:.2f} [{min(v) / args.layers:.2f}-"
                 f"{max(v) / args.layers:.2f}]" for name, v in samples.items()]
        matmuls = median_ms(layer_matmuls(metadata.num_tokens), args.repeats)
        print(f"{label}: attention ms per layer: {'  '.join(cells)};  f32 matmuls {matmuls:.2f} ms per layer")


if __name__ == "__main__":
    main()
