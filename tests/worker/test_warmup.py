"""Start-up warm-up: which eager shapes it plans, and that each dummy step really runs the model."""

from __future__ import annotations

import pathlib
from types import SimpleNamespace

import pytest
import torch

from conveyor.config import SchedulerConfig
from conveyor.worker.warmup import (
    EagerStep,
    compiled_kernel_count,
    eager_steps,
    max_sampling_rows,
    profile_sampling_requests,
    run_eager_step,
    sampler_variants,
    split_counts,
    warm_up,
    warm_up_full_sampler,
    warm_up_sampler,
)
from runner_harness import make_runner, write_tiny_llama


def _runner_like(max_num_seqs: int, max_num_batched_tokens: int, graphs: object | None) -> SimpleNamespace:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=4096)
    return SimpleNamespace(scheduler_config=config, max_position_embeddings=8192, cuda_graphs=graphs)


def test_no_graphs_plans_eager_decodes_and_a_full_budget_prefill() -> None:
    steps = eager_steps(_runner_like(256, 8192, graphs=None))
    assert EagerStep(num_decodes=1, prefill_tokens=0, context_len=4095) in steps  # split-KV path
    assert EagerStep(num_decodes=256, prefill_tokens=0, context_len=1) in steps  # unified, decode tile
    mixed = [step for step in steps if step.prefill_tokens]
    assert len(mixed) == 1 and mixed[0].prefill_tokens + mixed[0].num_decodes == 4096  # capped by max_model_len


def test_graphs_covering_everything_leave_no_eager_step() -> None:
    graphs = SimpleNamespace(decode_sizes=[1, 2, 256], mixed_sizes=[16, 2048])
    assert eager_steps(_runner_like(256, 2048, graphs)) == []


def test_budget_above_the_largest_mixed_graph_plans_one_eager_prefill() -> None:
    graphs = SimpleNamespace(decode_sizes=[1, 512], mixed_sizes=[16, 2048])
    steps = eager_steps(_runner_like(1024, 8192, graphs))
    assert [step.prefill_tokens for step in steps if step.prefill_tokens] == [4095]
    assert EagerStep(num_decodes=1024, prefill_tokens=0, context_len=1) in steps  # above the 512 bucket


def test_split_counts_cover_each_padded_width_once() -> None:
    assert list(split_counts()) == [2, 4, 8, 16, 32, 64]


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    return make_runner(write_tiny_llama(tmp_path_factory.mktemp("tiny")), num_blocks=64, max_model_len=128)


@pytest.mark.parametrize("step", [EagerStep(3, 0, 9), EagerStep(2, 37, 5), EagerStep(1, 100, 1)])
def test_dummy_steps_run_the_model_on_cpu(runner, step: EagerStep) -> None:  # noqa: ANN001
    before = runner.kv_caches[0].clone()
    run_eager_step(runner, step)
    assert not torch.equal(before, runner.kv_caches[0]), "the dummy step wrote no KV: nothing ran"


def test_sampler_warm_up_runs_every_variant(runner) -> None:  # noqa: ANN001
    assert {p.temperature == 0.0 for p in sampler_variants()} == {True, False}
    assert any(p.logprobs for p in sampler_variants()) and any(p.seed is not None for p in sampler_variants())
    warm_up_sampler(runner)  # raises if a variant's batch cannot be built or sampled


def test_the_full_size_sampler_step_is_the_profiles_own(runner) -> None:
    rows = max_sampling_rows(runner.scheduler_config, runner.num_speculative_tokens)
    assert rows == min(runner.scheduler_config.max_num_seqs, runner.scheduler_config.max_num_batched_tokens)
    requests = profile_sampling_requests(rows)
    assert len(requests) == rows and {r.params.top_p for r in requests} == {0.9}
    warm_up_full_sampler(runner)  # raises if the batch cannot be built or sampled


def test_warm_up_is_a_no_op_on_cpu(runner) -> None:  # noqa: ANN001
    before = runner.kv_caches[0].clone()
    warm_up(runner)
    assert torch.equal(before, runner.kv_caches[0])
    assert compiled_kernel_count() == 0  # no Triton on the CPU install


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_after_warm_up_eager_steps_compile_nothing(tmp_path: pathlib.Path) -> None:
    gpu_runner = make_runner(write_tiny_llama(tmp_path / "tiny"), num_blocks=512, max_model_len=256,
                             device="cuda", dtype="bfloat16")
    compiled = compiled_kernel_count()
    for step in (EagerStep(300, 0, 200), EagerStep(5, 250, 3), EagerStep(1, 0, 255), EagerStep(7, 0, 17)):
        run_eager_step(gpu_runner, step)
    torch.cuda.synchronize()
    assert compiled_kernel_count() == compiled
