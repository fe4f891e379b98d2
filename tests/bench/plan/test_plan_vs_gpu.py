"""The memory plan against the KV blocks the engine allocated on real GPUs (docs/decision.md, the GPU
question): Qwen3-32B shape, bf16, the default token budget 8192, gpu_memory_utilization 0.9. The engine's
counts are from its server logs (benchmarks/results/gpu-study-s1/*/*/server.log)."""

from __future__ import annotations

import pathlib

import pytest

from conveyor.bench.plan.gpu_catalog import find_gpu
from conveyor.bench.plan.memory import PlanInputs, fit_on, load_shape, model_memory

QWEN3_32B = pathlib.Path(__file__).parents[3] / "benchmarks" / "models" / "qwen3-32b"
BLOCK_BYTES = 16 * 262144  # 16 tokens × 256 KiB of K and V per token


@pytest.mark.parametrize(("gpu", "max_num_seqs", "engine_blocks"), [
    ("H100", 1024, 507),    # the defaults: the sampler's reserve for 1,024 rows takes most of the KV budget
    ("H100", 256, 1955),
    ("H200", 1024, 14475),
])
def test_the_plan_predicts_the_engines_kv_blocks_within_ten_percent(gpu: str, max_num_seqs: int,
                                                                    engine_blocks: int) -> None:
    inputs = PlanInputs(dtype="bfloat16", max_num_seqs=max_num_seqs, max_num_batched_tokens=8192)
    fit = fit_on(find_gpu(gpu), model_memory(load_shape(QWEN3_32B), inputs), inputs)
    planned = fit.kv_budget_bytes // BLOCK_BYTES
    assert abs(planned - engine_blocks) <= 0.10 * engine_blocks, (planned, engine_blocks)
