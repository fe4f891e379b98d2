"""benchmarks/gpu/sampler_bench.py (staged path against the fused one) and sampler_kernels.py (the fused
kernels alone): they import without a GPU, check their arguments and refuse to time without CUDA."""

import json

import pytest
import torch
from script_loader import load_script


def test_sampler_bench_dry_run_checks_shapes_and_flags(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_script("gpu/sampler_bench.py")
    bench.main(["--dry-run", "--num-rows", "1", "5", "--vocab-sizes", "8", "5000", "--temperature", "0.7"])
    rows = [json.loads(line.removeprefix("RESULT ")) for line in capsys.readouterr().out.splitlines()]
    assert [(r["num_rows"], r["vocab_size"]) for r in rows] == [(1, 8), (5, 8), (1, 5000), (5, 5000)]
    for bad in (["--dry-run", "--temperature", "0"], ["--dry-run", "--num-rows", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            bench.parse_args([])  # a timed run needs the GPU


def test_sampler_kernels_imports_and_refuses_bad_arguments_or_no_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_script("gpu/sampler_kernels.py")
    assert list(bench.KERNELS) == ["gumbel", "cdf"]
    for bad in (["--num-rows", "0"], ["--vocab-sizes", "1"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            bench.main([])
        assert "needs a CUDA GPU" in capsys.readouterr().err
