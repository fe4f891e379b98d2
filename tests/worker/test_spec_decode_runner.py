"""Speculative decoding in the model runner on the tiny dummy Llama, driven by the toy scheduler that
keeps the contract of core/outputs.py (spec_harness): outputs never depend on speculation."""

from __future__ import annotations

import pathlib

import pytest
import torch
from runner_harness import write_tiny_llama
from spec_harness import SpecScheduler, SpecStats, draft_model_of, make_spec_runner

from conveyor.config import SpeculativeConfig, SpeculativeMethod
from conveyor.core.outputs import CachedRequestData, SchedulerOutput
from conveyor.sampling_params import SamplingParams

PROMPTS = {
    "a": [(7 * i + 3) % 250 + 3 for i in range(23)],
    "b": [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],  # repeats: n-gram lookup finds drafts at once
    "c": [42],
    "d": [(11 * i + 5) % 250 + 3 for i in range(9)] * 2,
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
NGRAM = SpeculativeConfig(SpeculativeMethod.NGRAM, 3, prompt_lookup_min=1, prompt_lookup_max=3)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-spec"))


def draft_config(model_dir: pathlib.Path, k: int = 3) -> SpeculativeConfig:
    return SpeculativeConfig(SpeculativeMethod.DRAFT_MODEL, k, model=str(model_dir))


def generate(model_dir: pathlib.Path, config: SpeculativeConfig | None, params: SamplingParams = GREEDY,
             scheduler: SpecScheduler | None = None) -> tuple[dict[str, list[int]], SpecStats]:
    runner = make_spec_runner(model_dir, config)
    scheduler = scheduler or SpecScheduler(lookahead=config.num_lookahead_tokens if config else 0)
    for request_id, prompt in PROMPTS.items():
        scheduler.add(request_id, prompt, params)
    return scheduler.run(runner), scheduler.stats


def test_greedy_outputs_identical_off_ngram_and_draft_model(model_dir: pathlib.Path) -> None:
    reference, off = generate(model_dir, None)
    assert off.num_drafts == 0 and all(len(tokens) == 30 for tokens in reference.values())
    ngram, ngram_stats = generate(model_dir, NGRAM)
    assert ngram == reference
    assert 0 < ngram_stats.num_accepted < ngram_stats.num_drafts  # partial acceptance
    drafted, draft_stats = generate(model_dir, draft_config(model_dir))
    assert drafted == reference
    assert draft_stats.num_drafts > 60 and draft_stats.acceptance_rate == 1.0  # the draft is the target


def test_a_different_draft_model_is_partly_accepted_and_changes_nothing(model_dir: pathlib.Path) -> None:
    reference, _ = generate(model_dir, None)
    config = draft_config(model_dir, k=4)
    runner = make_spec_runner(model_dir, config)
    draft = draft_model_of(runner)
    assert draft is not None
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.01)
    scheduler = SpecScheduler(lookahead=config.num_lookahead_tokens)
    for request_id, prompt in PROMPTS.items():
        scheduler.add(request_id, prompt, GREEDY)
    assert scheduler.run(runner) == reference
    assert 0.2 < scheduler.stats.acceptance_rate < 0.95, scheduler.stats


@pytest.mark.parametrize("config_name", ["ngram", "draft"])
def test_chunked_prefill_and_no_lookahead_change_nothing(model_dir: pathlib.Path, config_name: str) -> None:
    reference, _ = generate(model_dir, None)
    config = NGRAM if config_name == "ngram" else draft_config(model_dir, k=4)
    chunked, stats = generate(model_dir, config, scheduler=SpecScheduler(chunk_size=5, lookahead=0))
    assert chunked == reference and stats.num_accepted > 0


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=11, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=3, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2,
                   min_tokens=10, max_tokens=24),
    SamplingParams(temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.4, max_tokens=24, ignore_eos=True),
])
def test_seeded_and_penalised_outputs_are_those_of_plain_decoding(model_dir: pathlib.Path,
                                                                  params: SamplingParams) -> None:
    """Each verified position samples with the seed stream and the history of sequential decoding."""
    reference, _ = generate(model_dir, None, params)
    for config in (NGRAM, draft_config(model_dir)):
        outputs, stats = generate(model_dir, config, params)
        assert outputs == reference and stats.num_drafts > 0


def test_logprobs_of_kept_tokens_match_plain_decoding(model_dir: pathlib.Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)

    def run(config: SpeculativeConfig | None) -> list[tuple[int, float, list[int]]]:
        runner, scheduler = make_spec_runner(model_dir, config), SpecScheduler()
        scheduler.add("b", PROMPTS["b"], params)
        records = []
        while not scheduler.requests["b"].done:
            sampled = scheduler.step(runner)["b"]
            assert scheduler.last_output is not None
            kept = scheduler.last_output.logprobs.get("b", [])
            assert [lp.token_id for lp in kept] == sampled
            records.extend((lp.token_id, lp.logprob, lp.top_token_ids) for lp in kept)
        return records

    plain, speculative = run(None), run(NGRAM)
    assert len(plain) == 12 and [r[0] for r in speculative] == [r[0] for r in plain]
    assert [r[2] for r in speculative] == [r[2] for r in plain]
    assert [r[1] for r in speculative] == pytest.approx([r[1] for r in plain], abs=1e-4)
