"""Tensor parallelism on CUDA (NCCL; skipped without GPUs): a group of one on one GPU runs the parallel layers,
their collectives and CUDA graphs that capture them, with tokens equal to the plain runner's; on two GPUs,
float32 tokens equal one GPU's, and bf16 CUDA graphs equal eager."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest
import torch

from conveyor.config import CacheConfig, DeviceConfig, EngineConfig, LoadFormat, ModelConfig, SchedulerConfig
from conveyor.engine.model_setup import build_engine_core
from conveyor.worker.tp_executor import TensorParallelExecutor
from tp_harness import TINY_LLAMA, build_engine_core_around, generate, prompts, tp

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@pytest.fixture()
def tiny_cuda(tmp_path: pathlib.Path) -> EngineConfig:
    (tmp_path / "config.json").write_text(json.dumps({**TINY_LLAMA, "num_attention_heads": 8,
                                                      "num_key_value_heads": 2, "head_dim": 16}))
    return EngineConfig(
        model=ModelConfig(model=str(tmp_path), load_format=LoadFormat.DUMMY, seed=5, dtype="bfloat16"),
        scheduler=SchedulerConfig(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64),
        cache=CacheConfig(block_size=16, num_blocks_override=64),
        device=DeviceConfig(device="cuda"),
        check_invariants=True,
    )


def with_dtype(config: EngineConfig, dtype: str, enforce_eager: bool = False) -> EngineConfig:
    return dataclasses.replace(config, model=dataclasses.replace(config.model, dtype=dtype),
                               device=dataclasses.replace(config.device, enforce_eager=enforce_eager))


def test_nccl_group_of_one_with_cuda_graphs_matches_the_plain_runner(tiny_cuda: EngineConfig) -> None:
    reference, _ = generate(build_engine_core(tiny_cuda), prompts(6, 301), max_tokens=12)
    with TensorParallelExecutor(tp(tiny_cuda, 1)) as executor:
        executor.initialize_kv_cache()
        assert executor.runner.cuda_graphs is not None  # the all-reduces are inside the captured graphs
        outputs, _ = generate(build_engine_core_around(executor, tiny_cuda), prompts(6, 301), max_tokens=12)
    assert outputs == reference


@TWO_GPUS
def test_two_gpus_float32_match_one(tiny_cuda: EngineConfig) -> None:
    config = with_dtype(tiny_cuda, "float32")
    reference, _ = generate(build_engine_core(config), prompts(6, 301), max_tokens=12)
    core = build_engine_core(tp(config, 2))
    try:
        outputs, _ = generate(core, prompts(6, 301), max_tokens=12)
    finally:
        core.shutdown()
    assert outputs == reference


@TWO_GPUS
def test_two_gpus_bf16_graphs_match_eager(tiny_cuda: EngineConfig) -> None:
    runs = []
    for eager in (True, False):
        core = build_engine_core(tp(with_dtype(tiny_cuda, "bfloat16", enforce_eager=eager), 2, async_scheduling=True))
        try:
            runs.append(generate(core, prompts(6, 301), max_tokens=12)[0])
        finally:
            core.shutdown()
    assert runs[0] == runs[1]
