"""The memory plan against the KV blocks the engine allocated on real GPUs (docs/decision.md, the GPU
question): Qwen3-32B shape, bf16, the default token budget 8192, gpu_memory_utilization 0.9. The engine's
counts are from its server logs (benchmarks/results/gpu-study-s1/*/*/server.log).

Each count carries the sampler it was measured with: "unchunked" (the whole-batch staged path, before
worker/sampler_staged.py) is checked against the plan with that sampler's reserve
(`unchunked_sampler_bytes`); "chunked" counts (benchmarks/gpu/kv_blocks.sh on the engine of today) are
checked against the plan as it stands (`sampler_bytes`)."""

from __future__ import annotations

import pathlib

import pytest

from conveyor.bench.plan.gpu_catalog import find_gpu
from conveyor.bench.plan.memory import PlanInputs, fit_on, load_shape, model_memory
from conveyor.bench.plan.sampler_memory import sampler_bytes, unchunked_sampler_bytes

QWEN3_32B = pathlib.Path(__file__).parents[3] / "benchmarks" / "models" / "qwen3-32b"
BLOCK_BYTES = 16 * 262144  # 16 tokens × 256 KiB of K and V per token
SAMPLER_RESERVES = {"unchunked": unchunked_sampler_bytes, "chunked": sampler_bytes}

ENGINE_BLOCKS = [
    # (GPU, max_num_seqs, the engine's KV blocks, the sampler it ran)
    ("H100", 1024, 507, "unchunked"),    # the defaults: the sampler's reserve for 1,024 rows took most of the KV budget
    ("H100", 256, 1955, "unchunked"),
    ("H200", 1024, 14475, "unchunked"),
    ("H200", 1024, 16033, "chunked"),     # benchmarks/gpu/kv_blocks.sh 1024 256 on 2026-12-06
    ("H200", 256, 16044, "chunked"),
    ("H100", 1024, 2066, "chunked"),      # benchmarks/gpu/kv_blocks.sh 1024 256 on 2026-12-07: the defaults
    ("H100", 256, 2076, "chunked"),       # now keep 4x the unchunked sampler's 507 blocks
]


def planned_blocks(gpu: str, max_num_seqs: int, sampler: str) -> int:
    inputs = PlanInputs(dtype="bfloat16", max_num_seqs=max_num_seqs, max_num_batched_tokens=8192,
                        gpu_memory_utilization=0.9)  # as the engine ran then
    memory = model_memory(load_shape(QWEN3_32B), inputs, SAMPLER_RESERVES[sampler])
    return fit_on(find_gpu(gpu), memory, inputs).kv_budget_bytes // BLOCK_BYTES


@pytest.mark.parametrize(("gpu", "max_num_seqs", "engine_blocks", "sampler"), ENGINE_BLOCKS)
def test_the_plan_predicts_the_engines_kv_blocks_within_ten_percent(gpu: str, max_num_seqs: int,
                                                                    engine_blocks: int, sampler: str) -> None:
    planned = planned_blocks(gpu, max_num_seqs, sampler)
    assert abs(planned - engine_blocks) <= 0.10 * engine_blocks, (planned, engine_blocks)


def test_the_chunked_sampler_leaves_the_kv_cache_what_the_whole_batch_took() -> None:
    # The plan's own prediction, not a measurement: at 1,024 rows the reserve falls from 8.1 to 1.4 GiB.
    before, after = planned_blocks("H100", 1024, "unchunked"), planned_blocks("H100", 1024, "chunked")
    assert (after - before) * BLOCK_BYTES == pytest.approx(
        unchunked_sampler_bytes(1024, 151_936) - sampler_bytes(1024, 151_936), abs=BLOCK_BYTES)


def test_the_plan_and_the_engine_default_to_vllm_0_24s_memory_utilization() -> None:
    # vLLM 0.24's CacheConfig defaults to 0.92 (0.9 before): a drop-in must size the pool the same, and the
    # plan must price the pool `serve` will allocate. At 0.9 conveyor's online pool was 857 blocks short.
    from conveyor.config import CacheConfig
    assert CacheConfig().gpu_memory_utilization == PlanInputs().gpu_memory_utilization == 0.92
