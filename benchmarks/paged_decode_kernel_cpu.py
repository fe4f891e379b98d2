#!/usr/bin/env python3
"""The C paged-decode kernel alone, a base revision's build against the worktree's, alternating in one process.

Each variant is kernels/cpu/paged_attention.c (with the headers beside it) of a git revision, or of
the working tree (`work`), compiled alone into its own .so with the flags of cpu_build.py and called
through ctypes. A case is SmolLM2-135M's attention geometry (9 query heads, 3 KV heads, head_dim 64,
block 16) at B sequences x L context with Q query tokens each; it gets 30 KV caches, one per layer,
each with its own block tables (a random permutation of its blocks unless --contiguous), so that a
"step" -- the 30 calls -- reads its K/V from DRAM, not from the 32 MB L3. Rounds alternate the
variants (a noisy moment of the shared machine hits both alike); a variant's number is the median
over rounds of its step time in milliseconds, with the min-max spread of the rounds. With one thread
the clock is this thread's CPU time, with more it is wall time. Prints the effective K/V read rate
(bytes of K/V the step reads / time).

    PYTHONPATH=src python benchmarks/paged_decode_kernel_cpu.py --variants main work \\
        --cases 8x500x1 1x1000x1 8x500x4 --rounds 15 --threads 1
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

REPO = pathlib.Path(__file__).resolve().parents[1]
CPU_DIR = "src/conveyor/kernels/cpu"
FILES = ("paged_attention.c", "attention_common.h", "vec.h")
HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30


def build(variant: str, out_dir: pathlib.Path) -> ctypes.CDLL:
    """Compile `variant`'s decode kernel (a git revision, `work` for the working tree, or a .c file's path)."""
    src = out_dir / variant.replace("/", "_")
    src.mkdir()
    for name in FILES:
        if variant.endswith(".c"):  # an experiment's copy of the kernel, with the working tree's headers
            text = pathlib.Path(variant if name == FILES[0] else REPO / CPU_DIR / name).read_text()
        elif variant == "work":
            text = (REPO / CPU_DIR / name).read_text()
        else:
            text = subprocess.run(["git", "show", f"{variant}:{CPU_DIR}/{name}"], cwd=REPO, check=True,
                                  capture_output=True, text=True).stdout
        (src / name).write_text(text)
    library = src / "kernel.so"
    subprocess.run(["gcc", *COMPILE_FLAGS, "-march=native", str(src / "paged_attention.c"), "-o", str(library)],
                   check=True)
    lib = ctypes.CDLL(str(library))
    lib.paged_decode_attention.argtypes = _SIGNATURES["paged_decode_attention"]
    lib.paged_decode_attention.restype = ctypes.c_int
    return lib


class Case:
    """B sequences of L tokens, Q query tokens each, over LAYERS separate paged caches."""

    def __init__(self, spec: str, contiguous: bool, hot: bool, seed: int) -> None:
        self.batch, self.context, self.q = map(int, spec.split("x"))
        gen = torch.Generator().manual_seed(seed)
        blocks_each = -(-self.context // BLOCK)
        num_blocks = self.batch * blocks_each
        self.caches, self.tables = [], []
        for layer in range(LAYERS):
            self.caches.append(self.caches[0] if hot and layer else
                               torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen))
            order = torch.arange(num_blocks) if contiguous else torch.randperm(num_blocks, generator=gen)
            self.tables.append(order.view(self.batch, blocks_each).int().contiguous())
        self.seq_lens = torch.full((self.batch,), self.context, dtype=torch.int32)
        self.query = torch.randn(self.batch * self.q, HEADS, HEAD_DIM, generator=gen)
        self.starts = torch.arange(self.batch) * self.q
        self.counts = torch.full((self.batch,), self.q)
        self.rows = torch.arange(self.batch)
        self.out = torch.empty_like(self.query)
        self.bytes = LAYERS * self.batch * self.context * KV_HEADS * HEAD_DIM * 4 * 2

    def step(self, lib: ctypes.CDLL, threads: int) -> None:
        for cache, table in zip(self.caches, self.tables):
            status = lib.paged_decode_attention(
                self.query.data_ptr(), cache.data_ptr(), self.starts.data_ptr(), self.counts.data_ptr(),
                self.rows.data_ptr(), table.data_ptr(), table.shape[1], self.seq_lens.data_ptr(), self.batch,
                HEADS, KV_HEADS, HEAD_DIM, BLOCK, cache.shape[1], HEAD_DIM**-0.5, self.out.data_ptr(), threads)
            assert status == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=["main", "work"])
    parser.add_argument("--cases", nargs="+", default=["8x500x1", "1x1000x1", "8x500x4"], help="BxLxQ")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--contiguous", action="store_true", help="blocks in order (default: shuffled)")
    parser.add_argument("--no-check", action="store_true", help="skip comparing the variants' outputs")
    parser.add_argument("--hot", action="store_true", help="one cache for every layer (in L3: the compute alone)")
    args = parser.parse_args()
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    with tempfile.TemporaryDirectory() as tmp:
        libs = {v: build(v, pathlib.Path(tmp)) for v in args.variants}
        for spec in args.cases:
            case = Case(spec, args.contiguous, args.hot, seed=0)
            outs = {}
            for v, lib in libs.items():  # warm-up, and every variant's output equal to the first's
                case.step(lib, args.threads)
                outs[v] = case.out.clone()
            for v in args.variants[1:] if not args.no_check else []:
                torch.testing.assert_close(outs[v], outs[args.variants[0]], atol=2e-6, rtol=1e-5)
            times: dict[str, list[float]] = {v: [] for v in args.variants}
            for _ in range(args.rounds):
                for v, lib in libs.items():
                    start = clock()
                    case.step(lib, args.threads)
                    times[v].append((clock() - start) * 1e3)
            for v in args.variants:
                ms = statistics.median(times[v])
                print(f"{spec:>9} threads {args.threads} {v:>10}: {ms:6.2f} ms / {LAYERS} layers "
                      f"(rounds {min(times[v]):.2f}-{max(times[v]):.2f}), {case.bytes / ms / 1e6:5.1f} GB/s")


if __name__ == "__main__":
    main()
