"""The model runner on CUDA (skipped without a GPU): same tokens as the CPU, Triton backend consistency,
KV cache sized by profiling."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import torch
from runner_harness import ToyScheduler, make_runner, write_tiny_llama

from conveyor.sampling_params import SamplingParams
from conveyor.worker.kv_cache import KVCacheSizingError

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = {f"r{i}": [(7 * i + 3 * j) % 250 + 3 for j in range(5 + 9 * i)] for i in range(6)}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-gpu"))


def run_all(runner, chunk_size: int, params: SamplingParams = GREEDY) -> dict[str, list[int]]:  # noqa: ANN001
    scheduler = ToyScheduler(chunk_size=chunk_size)
    for request_id, prompt in PROMPTS.items():
        scheduler.add(request_id, prompt, params)
    return scheduler.run(runner)


def test_cuda_float32_matches_cpu(model_dir: pathlib.Path) -> None:
    cpu = run_all(make_runner(model_dir), chunk_size=1 << 30)
    cuda = make_runner(model_dir, device="cuda", dtype="float32")
    assert cuda.attention_backend == "torch"
    assert run_all(cuda, chunk_size=8) == cpu


def test_cuda_bf16_triton_chunked_equals_one_shot(model_dir: pathlib.Path) -> None:
    runner = make_runner(model_dir, device="cuda")
    assert runner.attention_backend == "triton" and runner.kv_caches[0].dtype == torch.bfloat16
    one_shot = run_all(runner, chunk_size=1 << 30)
    assert run_all(make_runner(model_dir, device="cuda"), chunk_size=7) == one_shot
    reference = make_runner(model_dir, device="cuda", dtype="float32")
    float32 = run_all(reference, chunk_size=1 << 30)
    agree = sum(a == b for r in PROMPTS for a, b in zip(one_shot[r], float32[r]))
    assert agree >= 0.8 * sum(len(t) for t in float32.values())  # bf16 may flip a near-tie


def test_cuda_seeded_sampling_reproducible(model_dir: pathlib.Path) -> None:
    seeded = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, max_tokens=10, ignore_eos=True)
    first = run_all(make_runner(model_dir, device="cuda"), chunk_size=1 << 30, params=seeded)
    second = run_all(make_runner(model_dir, device="cuda"), chunk_size=5, params=seeded)
    assert first == second


def test_kv_cache_sized_by_profiling(model_dir: pathlib.Path) -> None:
    runner = make_runner(model_dir, num_blocks=None, device="cuda")
    _, total_bytes = torch.cuda.mem_get_info()
    num_blocks = runner.kv_caches[0].shape[1]
    spec = runner.kv_cache_spec
    assert num_blocks * spec.bytes_per_block <= 0.3 * total_bytes
    assert num_blocks * spec.bytes_per_block >= 0.3 * total_bytes - (4 << 30)  # tiny model: little else
    runner.profile_run()
    with pytest.raises(KVCacheSizingError):
        from dataclasses import replace
        runner.cache_config = replace(runner.cache_config, gpu_memory_utilization=1e-4)
        runner.initialize_kv_cache()


def test_pinned_staging_usable_outside_inference_mode(model_dir: pathlib.Path) -> None:
    runner = make_runner(model_dir, device="cuda")
    run_all(runner, chunk_size=1 << 30)  # buffers first created inside execute's inference mode
    staged = runner.staging.to_device("input_ids", np.arange(5, dtype=np.int64))
    assert staged.device.type == "cuda" and staged.tolist() == [0, 1, 2, 3, 4]
