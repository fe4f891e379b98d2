"""Tensor parallelism on real processes (gloo, CPU): greedy tokens equal to one rank, KV back to 0, the plan's
per-rank block count, a rank killed mid-run, refusals at start-up.

Every engine here is built by `build_engine_core`, as `conveyor serve` builds it, so rank 1 .. N-1 are spawned
processes and rank 0 is this one. SmolLM2 (9 heads, 3 KV heads) is split unevenly over 2 ranks (2 + 1 KV
heads): the real model, float32, as the issue asks. The tiny dummy Llama has one KV head, replicated.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import pathlib
import signal
import time

import pytest
import torch.distributed as dist

from conveyor.bench.plan.memory import kv_capacity, load_shape, shape_per_rank
from conveyor.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    LoadFormat,
    ModelConfig,
    ParallelConfig,
    Quantization,
    SchedulerConfig,
)
from conveyor.engine.model_setup import build_engine_core
from conveyor.model.tensor_parallel import TensorParallelError
from conveyor.request import Request
from conveyor.sampling_params import SamplingParams
from conveyor.worker.tp_executor import RankFailedError, RankFailure, TensorParallelExecutor
from tp_harness import TINY_LLAMA, build_engine_core_around, generate, prompts, tp

pytestmark = pytest.mark.slow

SMOLLM2_SHAPE = pathlib.Path(__file__).resolve().parents[1] / "bench" / "fixtures" / "models" / "smollm2-135m"
SMOLLM2 = EngineConfig(
    model=ModelConfig(quantization=Quantization.NONE),
    scheduler=SchedulerConfig(max_model_len=200, max_num_seqs=16, max_num_batched_tokens=64),
    cache=CacheConfig(block_size=16, kv_cache_memory_bytes=13_000_000),
    device=DeviceConfig(num_threads=1),
    check_invariants=True,
)
SMOLLM2_TOKENS = 8
"""Generated per prompt: enough for the 16 prompts (5-120 tokens) to outgrow the 26-block pool (3 preemptions
at 8, none at 4; both runs assert some); 16 only cost more steps, each an all-reduce per layer on 2 cores."""


@pytest.fixture(scope="module")
def smollm2_reference() -> tuple[dict[str, list[int]], int]:
    """One rank, the same number of blocks as the 2-rank engine below gets from its memory budget."""
    blocks = kv_capacity(shape_per_rank(load_shape(SMOLLM2_SHAPE), 2), 13_000_000, 16, "float32").num_blocks
    config = dataclasses.replace(SMOLLM2, cache=dataclasses.replace(SMOLLM2.cache, num_blocks_override=blocks))
    core = build_engine_core(config)
    return generate(core, prompts(16, 49152), max_tokens=SMOLLM2_TOKENS)


def test_smollm2_on_two_ranks_matches_one_rank(smollm2_reference: tuple[dict[str, list[int]], int]) -> None:
    reference, reference_preemptions = smollm2_reference
    assert reference_preemptions > 0, "the pool was meant to be small enough to force preemptions"
    core = build_engine_core(tp(SMOLLM2, 2, async_scheduling=True))  # rank 0 pipelined too: collects a step late
    try:
        # conveyor plan --tensor-parallel-size 2 --kv-cache-memory 13000000: rank 0 caches 2 of the 3 KV heads.
        planned = kv_capacity(shape_per_rank(load_shape(SMOLLM2_SHAPE), 2), 13_000_000, 16, "float32")
        assert core.limits.num_kv_blocks == planned.num_blocks == 26
        outputs, num_preemptions = generate(core, prompts(16, 49152), max_tokens=SMOLLM2_TOKENS)
    finally:
        core.shutdown()
    assert num_preemptions > 0
    assert outputs == reference


def tiny_engine_config(directory: pathlib.Path, hf_config: dict) -> EngineConfig:
    (directory / "config.json").write_text(json.dumps(hf_config))
    return EngineConfig(
        model=ModelConfig(model=str(directory), load_format=LoadFormat.DUMMY, seed=5),
        scheduler=SchedulerConfig(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64),
        cache=CacheConfig(block_size=16, num_blocks_override=64),
        device=DeviceConfig(num_threads=1),
        check_invariants=True,
    )


@pytest.fixture()
def tiny_llama(tmp_path: pathlib.Path) -> EngineConfig:
    return tiny_engine_config(tmp_path, TINY_LLAMA)


# Llama: one KV head, replicated on both ranks, untied LM head; Qwen3: per-head q/k norms, tied embeddings.
QWEN3 = {**TINY_LLAMA, "architectures": ["Qwen3ForCausalLM"], "num_key_value_heads": 2, "head_dim": 16,
         "tie_word_embeddings": True}


@pytest.mark.parametrize("hf_config", [TINY_LLAMA, QWEN3], ids=["llama", "qwen3"])
def test_dummy_weights_are_the_same_model_at_every_size(tmp_path: pathlib.Path, hf_config: dict) -> None:
    config = tiny_engine_config(tmp_path, hf_config)
    reference, _ = generate(build_engine_core(config), prompts(6, 301), max_tokens=10)
    core = build_engine_core(tp(config, 2))
    try:
        outputs, _ = generate(core, prompts(6, 301), max_tokens=10)
    finally:
        core.shutdown()
    assert outputs == reference


def test_world_size_one_runs_the_parallel_layers_in_process(tiny_llama: EngineConfig) -> None:
    reference, _ = generate(build_engine_core(tiny_llama), prompts(4, 301), max_tokens=6)
    with TensorParallelExecutor(tp(tiny_llama, 1)) as executor:  # a group of one: the collectives are no-ops
        executor.initialize_kv_cache()
        core = build_engine_core_around(executor, tiny_llama)
        outputs, _ = generate(core, prompts(4, 301), max_tokens=6)
    assert outputs == reference
    assert not dist.is_initialized()


def test_a_killed_rank_fails_the_next_step_and_the_group(tiny_llama: EngineConfig) -> None:
    failures: list[RankFailure] = []
    core = build_engine_core(tp(tiny_llama, 2), on_rank_failure=failures.append)
    executor = core.runner
    assert isinstance(executor, TensorParallelExecutor)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    core.add_request(Request("long", [5, 6, 7, 8], params, arrival_s=0.0))
    for _ in range(3):
        core.step()
    (pid,) = executor.rank_pids
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 1 .* killed by signal 9"):
        for _ in range(1000):
            core.step()
    assert time.monotonic() - started < 10.0
    assert failures == [RankFailure(1, pid, -signal.SIGKILL)]
    with pytest.raises(RankFailedError, match="the tensor-parallel group is down"):
        executor.execute(core.scheduler.schedule())
    core.shutdown()
    assert not multiprocessing.active_children() and not dist.is_initialized()


def test_impossible_setups_are_refused_before_any_rank_starts(tiny_llama: EngineConfig) -> None:
    with pytest.raises(TensorParallelError, match="--tensor-parallel-size 5 is more than the model's 4 attention"):
        build_engine_core(tp(tiny_llama, 5))
    cuda = dataclasses.replace(tiny_llama, device=DeviceConfig(device="cuda"))
    with pytest.raises(TensorParallelError, match="--tensor-parallel-size 2 needs 2 GPUs with NCCL; 0 visible"):
        build_engine_core(tp(cuda, 2))
    gguf = dataclasses.replace(SMOLLM2, model=ModelConfig(quantization=Quantization.GGUF))
    with pytest.raises(TensorParallelError, match="--quantization gguf does not run with --tensor-parallel-size"):
        build_engine_core(tp(gguf, 2))
    assert not multiprocessing.active_children()


def test_a_rank_that_cannot_load_fails_start_up_cleanly(tmp_path: pathlib.Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))  # safetensors asked for, none there
    config = EngineConfig(model=ModelConfig(model=str(tmp_path), load_format=LoadFormat.SAFETENSORS),
                          parallel=ParallelConfig(tensor_parallel_size=2), device=DeviceConfig(num_threads=1))
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        build_engine_core(config)
    assert not multiprocessing.active_children() and not dist.is_initialized()
