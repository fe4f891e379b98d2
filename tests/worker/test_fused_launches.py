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
from runner_harness import (
    TINY_LLAMA,
    ToyScheduler,
    force_tokens,
    record_logits,
    sharpen,
)

from conveyor.config import (
    CacheConfig,
    DeviceConfig,
    LoadFormat,
    ModelConfig,
    SchedulerConfig,
)
from conveyor.sampling_params import SamplingParams
from conveyor.worker.model_runner import ModelRunner

QWEN3 = {**TINY_LLAMA, "architectures": ["Qwen3ForCausalLM"], "head_dim": 16, "tie_word_embeddings": True}
MODELS = {"llama": TINY_LLAMA, "qwen3": QWEN3}
PROMPTS = {f"r{i}": [(7 * i + 3 * j) % 250 + 3 for j in range(5 + 9 * i)] for i in range(6)}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
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


def _run(runner: ModelRunner, forced: dict[str, list[int]] | None = None
         ) -> tuple[list[torch.Tensor], dict[str, list[int]]]:
    """Every step's sampled logits [S, V] over the prompts, chunked so prefills mix with decodes, and each
    request's tokens; `forced`: tokens taken whatever the model says (teacher forcing: another run's inputs)."""
    calls = record_logits(runner)
    if forced is not None:
        force_tokens(runner, forced)
    scheduler = ToyScheduler(chunk_size=7)
    for request_id, prompt in PROMPTS.items():
        scheduler.add(request_id, prompt, GREEDY)
    outputs = scheduler.run(runner)
    return calls, outputs


def _logits(runner: ModelRunner) -> list[torch.Tensor]:
    return _run(runner)[0]


def _assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want) > 0
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"step {step}: {(a != b).sum().item()} logits differ"


@pytest.mark.parametrize("name", MODELS)
def test_cpu_residual_stream_equals_the_plain_loop(tmp_path: pathlib.Path, name: str) -> None:
    plain = _runner(tmp_path / name, MODELS[name], "cpu", fused=True, eager=True)
    assert not plain.model.uses_residual_stream(torch.zeros(1, 64))  # the CPU keeps the plain loop
    stream = _runner(tmp_path / name, MODELS[name], "cpu", fused=True, eager=True)
    stream.model.uses_residual_stream = lambda x: True  # type: ignore[method-assign]
    _assert_same(_logits(stream), _logits(plain))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("name", MODELS)
def test_cuda_fused_logits_equal_the_separate_kernels(tmp_path: pathlib.Path, name: str, eager: bool) -> None:
    fused = _runner(tmp_path / name, MODELS[name], "cuda", fused=True, eager=eager)
    assert fused.model.dtype == torch.bfloat16
    assert fused.model.uses_residual_stream(torch.zeros(1, 64, dtype=torch.bfloat16, device="cuda"))
    separate = _runner(tmp_path / name, MODELS[name], "cuda", fused=False, eager=eager)
    want, tokens = _run(separate)
    if name == "llama":
        _assert_same(_logits(fused), want)
        return
    got, _ = _run(fused, forced=tokens)
    assert len(got) == len(want) > 0
    errors = [float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(got, want, strict=True)]
    print(f"{name} {eager=}: logits relative error max {max(errors):.2e}")
    assert max(errors) <= 2e-2
