"""Speculative decoding on CUDA (skipped without a GPU): float32 tokens equal the CPU's; with bf16, the
Triton backend and CUDA graphs (verification steps replay mixed graphs) speculation changes (almost)
nothing and a draft equal to the target is accepted (almost) always; seeded runs repeat."""

from __future__ import annotations

import pathlib

import pytest
import torch
from runner_harness import write_tiny_llama
from spec_harness import SpecScheduler, SpecStats, make_spec_runner

from conveyor.config import SpeculativeConfig, SpeculativeMethod
from conveyor.sampling_params import SamplingParams
from conveyor.worker.model_runner import ModelRunner

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = {f"r{i}": ([(7 * i + 3 * j) % 250 + 3 for j in range(4 + 3 * i)] * 2) for i in range(6)}
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
NGRAM = SpeculativeConfig(SpeculativeMethod.NGRAM, 3, prompt_lookup_min=1, prompt_lookup_max=3)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-spec-gpu"))


def run_all(runner: ModelRunner, config: SpeculativeConfig | None,
            params: SamplingParams = GREEDY) -> tuple[dict[str, list[int]], SpecStats]:
    scheduler = SpecScheduler(chunk_size=7, lookahead=config.num_lookahead_tokens if config else 0)
    for request_id, prompt in PROMPTS.items():
        scheduler.add(request_id, prompt, params)
    return scheduler.run(runner), scheduler.stats


def test_cuda_float32_speculation_matches_cpu(model_dir: pathlib.Path) -> None:
    cpu, _ = run_all(make_spec_runner(model_dir, None), None)
    draft = SpeculativeConfig(SpeculativeMethod.DRAFT_MODEL, 3, model=str(model_dir))
    for config in (NGRAM, draft):
        runner = make_spec_runner(model_dir, config, device="cuda", dtype="float32")
        outputs, stats = run_all(runner, config)
        assert outputs == cpu and stats.num_accepted > 0


def test_cuda_graphs_bf16_verification(model_dir: pathlib.Path) -> None:
    plain = make_spec_runner(model_dir, None, device="cuda")
    assert plain.cuda_graphs is not None and plain.cuda_graphs.mixed_graphs
    reference, _ = run_all(plain, None)
    total = sum(len(tokens) for tokens in reference.values())
    draft = SpeculativeConfig(SpeculativeMethod.DRAFT_MODEL, 3, model=str(model_dir))
    for config in (NGRAM, draft):
        runner = make_spec_runner(model_dir, config, device="cuda")
        assert runner.cuda_graphs is not None and runner.cuda_graphs.geometry.max_logits_rows >= 4 * 16
        outputs, stats = run_all(runner, config)
        agree = sum(a == b for r in PROMPTS for a, b in zip(outputs[r], reference[r]))
        assert agree >= 0.8 * total  # bf16: a verification step's kernels round differently than a decode's
        assert stats.num_accepted > 0
        if config is draft:
            assert stats.acceptance_rate >= 0.9


def test_cuda_seeded_speculation_repeats(model_dir: pathlib.Path) -> None:
    seeded = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, max_tokens=12, ignore_eos=True)
    first, _ = run_all(make_spec_runner(model_dir, NGRAM, device="cuda"), NGRAM, seeded)
    second, _ = run_all(make_spec_runner(model_dir, NGRAM, device="cuda"), NGRAM, seeded)
    assert first == second
