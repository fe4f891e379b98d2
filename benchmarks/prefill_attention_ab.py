"""A/B of paged_prefill.c variants in one process: each source compiled alone (the flags of cpu_build,
the headers of kernels/cpu/) into its own library, checked against the torch reference, then timed
in alternation so that a neighbour's load on the shared machine hits every variant alike.

    PYTHONPATH=src python benchmarks/prefill_attention_ab.py A.c B.c [--shape 900,900:0 ...] [--rounds 7]
        [--threads 1] [--march native]

A shape is comma-separated chunk lengths and the cached context before each (tokens); SmolLM2-135M's
attention geometry (9 heads, 3 KV heads, head_dim 64, block 16). Prints, per shape and variant, the
median ms per layer (one call), its spread (min-max of the per-round medians) and GFLOP/s of useful
causal work (4 D FLOPs per query head and visible key).
"""

from __future__ import annotations

import argparse
import ctypes
import pathlib
import statistics
import subprocess
import tempfile
import time

import torch

from conveyor.kernels.cpu_build import _SIGNATURES, COMPILE_FLAGS
from conveyor.kernels.paged_attention_cpu import paged_prefill_attention_ref

HEADERS = pathlib.Path(__file__).resolve().parents[1] / "src/conveyor/kernels/cpu"
H, KVH, D, BS = 9, 3, 64, 16


def build(source: str, out_dir: pathlib.Path, index: int, march: str) -> ctypes.CDLL:
    library = out_dir / f"variant{index}.so"
    subprocess.run(["gcc", *COMPILE_FLAGS, f"-march={march}", f"-I{HEADERS}", source, "-o", str(library)], check=True)
    lib = ctypes.CDLL(str(library))
    lib.paged_prefill_attention.argtypes = _SIGNATURES["paged_prefill_attention"]
    lib.paged_prefill_attention.restype = ctypes.c_int
    return lib


def make_case(chunks: list[int], ctx: int):
    per_seq = [-(-(c + ctx) // BS) for c in chunks]
    kv = torch.randn(2, sum(per_seq) + 4, BS, KVH, D)
    tables = torch.zeros(len(chunks), max(per_seq), dtype=torch.int32)
    first = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = torch.arange(first, first + n)
        first += n
    query = torch.randn(sum(chunks), H, D)
    starts = torch.tensor([sum(chunks[:i]) for i in range(len(chunks))])
    args = (query, kv, starts, torch.tensor(chunks), torch.arange(len(chunks)), tables,
            torch.tensor([c + ctx for c in chunks], dtype=torch.int32), D**-0.5)
    flops = sum(H * (c * ctx + c * (c + 1) / 2) * D * 4 for c in chunks)
    return args, flops


def call(lib: ctypes.CDLL, args, out: torch.Tensor, threads: int) -> None:
    query, kv, starts, counts, rows, tables, seq_lens, scale = args
    status = lib.paged_prefill_attention(
        query.data_ptr(), kv.data_ptr(), starts.data_ptr(), counts.data_ptr(), rows.data_ptr(), tables.data_ptr(),
        tables.shape[1], seq_lens.data_ptr(), starts.numel(), H, KVH, D, BS, kv.shape[1], scale, out.data_ptr(), threads)
    assert status == 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("sources", nargs="+")
    parser.add_argument("--shape", action="append", help="chunks:ctx, e.g. 900,900:0")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=5, help="calls per variant per round")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--march", default="native", help="e.g. x86-64-v3: the build without AVX-512")
    opts = parser.parse_args()
    shapes = opts.shape or ["900,900:0", "900:500", "64,64,64,64:0", "300:0"]
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        libs = [build(s, pathlib.Path(tmp), i, opts.march) for i, s in enumerate(opts.sources)]
        for shape in shapes:
            chunk_text, _, ctx_text = shape.partition(":")
            args, flops = make_case([int(c) for c in chunk_text.split(",")], int(ctx_text or 0))
            expected = torch.empty_like(args[0])
            paged_prefill_attention_ref(*args, expected)
            out = torch.empty_like(args[0])
            rounds: list[list[float]] = [[] for _ in libs]
            for lib, source in zip(libs, opts.sources):
                call(lib, args, out, opts.threads)
                error = (out - expected).abs().max().item()
                assert error < 1e-5, f"{source}: max error {error}"
            for _ in range(opts.rounds):
                for i, lib in enumerate(libs):
                    times = []
                    for _ in range(opts.calls):
                        start = time.perf_counter()
                        call(lib, args, out, opts.threads)
                        times.append(time.perf_counter() - start)
                    rounds[i].append(statistics.median(times))
            for source, medians in zip(opts.sources, rounds):
                m = statistics.median(medians)
                print(f"{shape:>16} {source:>28}: {m * 1e3:7.3f} ms ({min(medians) * 1e3:.3f}-{max(medians) * 1e3:.3f})"
                      f"  {flops / m / 1e9:5.1f} GFLOP/s")


if __name__ == "__main__":
    main()
