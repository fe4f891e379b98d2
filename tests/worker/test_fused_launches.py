"""The fused launches across layer boundaries (residual add + norm, Qwen3's q/k norm + rope): a tiny Llama gives
identical logits with them and with the separate kernels on CUDA (bf16, CUDA graphs and eager); a tiny Qwen3's
stay within bf16 rounding of them (the fused q/k norm's row sum is compiled with another reduction tree: the
H100 said so on 2026-12-07), compared on the same inputs; on the CPU the residual-stream stack equals the
plain loop bit for bit."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from runner_harness import TINY_MODELS, run_mixed_steps, sharpen

from conveyor.config import (
    CacheConfig,
    DeviceConfig,
    LoadFormat,
    ModelConfig,
    SchedulerConfig,
)
from conveyor.worker.model_runner import ModelRunner

CUDA = torch.cuda.is_available()


def _runner(directory: pathlib.Path, hf_config: dict, device: str, fused: bool, eager: bool) -> ModelRunner:
    """A runner on the tiny model with the fused launches on or off before any CUDA graph is captured."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config))
    runner = ModelRunner(
        ModelConfig(model=str(directory), load_format=LoadFormat.DUMMY, seed=0),
        CacheConfig(block_size=4, num_blocks_override=256, gpu_memory_utilization=0.3),
        SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=256),
        DeviceConfig(device=device, enforce_eager=eager),
    )
    sharpen(runner.model)
    runner.model.set_fused_launches(fused)
    runner.initialize_kv_cache()
    return runner


def _logits(runner: ModelRunner) -> list[torch.Tensor]:
    return run_mixed_steps(runner)[0]


def _assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want) > 0
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"step {step}: {(a != b).sum().item()} logits differ"


@pytest.mark.parametrize("name", TINY_MODELS)
def test_cpu_residual_stream_equals_the_plain_loop(tmp_path: pathlib.Path, name: str) -> None:
    plain = _runner(tmp_path / name, TINY_MODELS[name], "cpu", fused=True, eager=True)
    assert not plain.model.uses_residual_stream(torch.zeros(1, 64))  # the CPU keeps the plain loop
    stream = _runner(tmp_path / name, TINY_MODELS[name], "cpu", fused=True, eager=True)
    stream.model.uses_residual_stream = lambda x: True  # type: ignore[method-assign]
    _assert_same(_logits(stream), _logits(plain))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("name", TINY_MODELS)
def test_cuda_fused_logits_equal_the_separate_kernels(tmp_path: pathlib.Path, name: str, eager: bool) -> None:
    fused = _runner(tmp_path / name, TINY_MODELS[name], "cuda", fused=True, eager=eager)
    assert fused.model.dtype == torch.bfloat16
    assert fused.model.uses_residual_stream(torch.zeros(1, 64, dtype=torch.bfloat16, device="cuda"))
    separate = _runner(tmp_path / name, TINY_MODELS[name], "cuda", fused=False, eager=eager)
    want, tokens = run_mixed_steps(separate)
    if name == "llama":
        _assert_same(_logits(fused), want)
        return
    got, _ = run_mixed_steps(fused, forced=tokens)
    assert len(got) == len(want) > 0
    errors = [float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(got, want, strict=True)]
    print(f"{name} {eager=}: logits relative error max {max(errors):.2e}")
    assert max(errors) <= 2e-2
