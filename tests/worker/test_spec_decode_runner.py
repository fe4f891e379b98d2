"""Speculative decoding in the model runner on the tiny dummy Llama, driven by the toy scheduler that
keeps the contract of core/outputs.py (spec_harness): outputs never depend on speculation."""

from __future__ import annotations

import json
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


@pytest.mark.parametrize("config_name", ["ngram", "draft"])
def test_preemption_and_resumption_change_nothing(model_dir: pathlib.Path, config_name: str) -> None:
    reference, _ = generate(model_dir, None)
    config = NGRAM if config_name == "ngram" else draft_config(model_dir)
    runner, scheduler = make_spec_runner(model_dir, config), SpecScheduler(lookahead=config.num_lookahead_tokens)
    for request_id, prompt in PROMPTS.items():
        scheduler.add(request_id, prompt, GREEDY)
    for step in range(40):
        if step in (4, 9):
            scheduler.preempt("b")
            scheduler.preempt("d")
        scheduler.step(runner)
    assert scheduler.run(runner) == reference


def test_prefix_cached_blocks_hold_the_draft_models_kv_too(model_dir: pathlib.Path) -> None:
    """A prefix-cache hit skips the draft model's prefill as well: its KV sits in the same blocks."""
    config = draft_config(model_dir)
    runner, first = make_spec_runner(model_dir, config), SpecScheduler(lookahead=3)
    first.add("a", PROMPTS["a"], GREEDY)
    expected = first.run(runner)["a"]
    again = SpecScheduler(lookahead=3)
    again.next_block = first.next_block
    again.add("a2", PROMPTS["a"], GREEDY, cached_blocks=first.requests["a"].block_ids[:5], num_computed=20)
    assert again.run(runner)["a2"] == expected
    assert again.stats.num_drafts > 20 and again.stats.acceptance_rate == 1.0  # garbage KV would reject drafts


def test_contract_violations_are_reported(model_dir: pathlib.Path) -> None:
    plain = make_spec_runner(model_dir, None)
    scheduler = SpecScheduler()
    scheduler.add("b", PROMPTS["b"], GREEDY)
    scheduler.step(plain)
    scheduler.drafts["b"] = [7, 8]
    with pytest.raises(ValueError, match="speculative decoding is off"):
        plain.execute(scheduler.schedule())

    runner, scheduler = make_spec_runner(model_dir, NGRAM), SpecScheduler()
    scheduler.add("b", PROMPTS["b"], GREEDY)
    while not scheduler.drafts.get("b"):
        scheduler.step(runner)
    request = scheduler.requests["b"]
    state = runner.states["b"]
    drafts = scheduler.drafts["b"]
    cached = CachedRequestData()
    cached.append("b", [200, 201], request.num_computed)  # slots for all, but the range stops short
    short = SchedulerOutput([], cached, {"b": len(drafts)}, len(drafts), scheduled_spec_decode_tokens={"b": drafts})
    with pytest.raises(ValueError, match="range ends before them"):
        runner.execute(short)
    assert runner.states["b"] is state and len(state.token_ids) == request.num_tokens
    no_rollback = CachedRequestData()
    no_rollback.append("b", [], request.num_computed + 2)  # as if two rejected drafts had been kept
    with pytest.raises(ValueError, match="known tokens"):
        runner.execute(SchedulerOutput([], no_rollback, {"b": 1}, 1))


def test_kv_cache_sizing_counts_the_draft_models_cache(model_dir: pathlib.Path) -> None:
    from conveyor.config import CacheConfig, DeviceConfig, LoadFormat, ModelConfig, SchedulerConfig
    from conveyor.worker.model_runner import ModelRunner

    def capacity(config: SpeculativeConfig | None):  # noqa: ANN202
        runner = ModelRunner(ModelConfig(model=str(model_dir), load_format=LoadFormat.DUMMY),
                             CacheConfig(block_size=4, kv_cache_memory_bytes=1 << 20),
                             SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
                             DeviceConfig(), config)
        return runner, runner.initialize_kv_cache()

    _, alone = capacity(None)
    runner, shared = capacity(draft_config(model_dir))
    assert shared.num_blocks == alone.num_blocks // 2  # the draft is the target's shape: twice the bytes per block
    draft = runner.spec_decoder.proposer  # type: ignore[union-attr]
    assert draft.kv_caches[0].shape == runner.kv_caches[0].shape  # type: ignore[attr-defined]
    assert shared.num_bytes == 2 * shared.num_blocks * runner.kv_cache_spec.bytes_per_block


def test_a_bad_draft_model_is_refused_naming_the_key(model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """A missing draft, or one with another vocabulary, fails at start-up naming speculative_config's
    'model' (not --model, the target's flag)."""
    from runner_harness import TINY_LLAMA

    from conveyor.model.loader import ModelNotFoundError

    missing = SpeculativeConfig(SpeculativeMethod.DRAFT_MODEL, 3, model=str(tmp_path / "nope.gguf"))
    with pytest.raises(ModelNotFoundError, match="speculative_config: the draft 'model' .*nope.gguf' does not exist"):
        make_spec_runner(model_dir, missing)
    other = tmp_path / "other-vocab"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**TINY_LLAMA, "vocab_size": TINY_LLAMA["vocab_size"] + 8}))
    with pytest.raises(ValueError, match="speculative_config: the draft model .* has a vocabulary of"):
        make_spec_runner(model_dir, draft_config(other))
