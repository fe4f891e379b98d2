"""The model runner on a tiny dummy-weight Llama, fed hand-built SchedulerOutputs (runner_harness)."""

from __future__ import annotations

import pathlib

import pytest
import torch
from runner_harness import ToyScheduler, make_runner, record_logits, write_tiny_llama

from conveyor.core.outputs import CachedRequestData, SchedulerOutput
from conveyor.sampling_params import SamplingParams
from conveyor.worker.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
PROMPTS = {
    "a": [(7 * i + 3) % 250 + 3 for i in range(23)],
    "b": [(11 * i + 5) % 250 + 3 for i in range(9)],
    "c": [(13 * i + 1) % 250 + 3 for i in range(31)],
    "d": [42],
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture()
def runner(model_dir: pathlib.Path) -> ModelRunner:
    return make_runner(model_dir)


def prefill_logits(runner: ModelRunner, scheduler: ToyScheduler) -> tuple[list[int], torch.Tensor]:
    """Run request "a" to completion; return its tokens and the logits of its first sample."""
    calls = record_logits(runner)
    tokens = scheduler.run(runner)["a"]
    return tokens, calls[0]


def test_exposes_model_facts(runner: ModelRunner) -> None:
    assert runner.vocab_size == 256 and runner.eos_token_ids == (2,)
    assert runner.max_position_embeddings == 512
    assert runner.kv_caches[0].shape == (2, 256, 4, 2, 16) and len(runner.kv_caches) == 2


def test_initialize_kv_cache_reports_capacity(model_dir: pathlib.Path) -> None:
    capacity = make_runner(model_dir, num_blocks=100).initialize_kv_cache()
    assert capacity.num_blocks == 100 and capacity.num_tokens == 400
    assert capacity.num_bytes == 100 * 4 * 2 * 2 * 2 * 16 * 4
    assert capacity.max_concurrency == 100 / 64


def test_chunked_and_prefix_prefill_match_one_shot(model_dir: pathlib.Path) -> None:
    one_shot = ToyScheduler()
    one_shot.add("a", PROMPTS["a"], GREEDY)
    tokens, logits = prefill_logits(make_runner(model_dir), one_shot)

    chunked = ToyScheduler(chunk_size=8)  # 23 prompt tokens in 3 chunks: 8 + 8 + 7
    chunked.add("a", PROMPTS["a"], GREEDY)
    chunked_tokens, chunked_logits = prefill_logits(make_runner(model_dir), chunked)

    runner = make_runner(model_dir)
    warm = ToyScheduler()
    warm.add("warm", PROMPTS["a"][:20] + [9, 9, 9], SamplingParams(temperature=0.0, max_tokens=1))
    warm.run(runner)  # fills blocks 0..5 with the KV of the first 20 prompt tokens (5 full blocks)
    prefix = ToyScheduler(first_block=100)
    prefix.add("a", PROMPTS["a"], GREEDY, cached_blocks=[0, 1, 2, 3, 4], num_computed=20)
    prefix_tokens, prefix_logits = prefill_logits(runner, prefix)

    assert chunked_tokens == tokens and prefix_tokens == tokens
    torch.testing.assert_close(chunked_logits, logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(prefix_logits, logits, rtol=1e-4, atol=1e-4)


def test_partial_chunk_samples_nothing(runner: ModelRunner) -> None:
    scheduler = ToyScheduler(chunk_size=8)
    scheduler.add("a", PROMPTS["a"], GREEDY)
    assert scheduler.step(runner) == {"a": []}
    assert scheduler.step(runner) == {"a": []}
    assert len(scheduler.step(runner)["a"]) == 1


def test_batched_equals_each_alone(model_dir: pathlib.Path) -> None:
    alone = {}
    for request_id, prompt in PROMPTS.items():
        scheduler = ToyScheduler()
        scheduler.add(request_id, prompt, GREEDY)
        alone[request_id] = scheduler.run(make_runner(model_dir))[request_id]
    batched = ToyScheduler(chunk_size=16)
    for request_id, prompt in PROMPTS.items():
        batched.add(request_id, prompt, GREEDY)
    assert batched.run(make_runner(model_dir)) == alone


def test_staggered_arrivals_mix_prefill_and_decode(model_dir: pathlib.Path) -> None:
    reference = ToyScheduler()
    for request_id, prompt in PROMPTS.items():
        reference.add(request_id, prompt, GREEDY)
    expected = reference.run(make_runner(model_dir))
    runner = make_runner(model_dir)
    staggered = ToyScheduler(chunk_size=5)
    for request_id, prompt in PROMPTS.items():  # a new request joins while others decode
        staggered.add(request_id, prompt, GREEDY)
        staggered.step(runner, only=set(list(staggered.requests)))
    assert staggered.run(runner) == expected


def test_preempt_and_resume_recomputes_the_same_tokens(model_dir: pathlib.Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12)
    reference = ToyScheduler()
    reference.add("a", PROMPTS["a"], params)
    reference.add("b", PROMPTS["b"], params)
    expected = reference.run(make_runner(model_dir))
    runner = make_runner(model_dir)
    scheduler = ToyScheduler()
    scheduler.add("a", PROMPTS["a"], params)
    scheduler.add("b", PROMPTS["b"], params)
    for _ in range(5):
        scheduler.step(runner)
    scheduler.preempt("a")
    scheduler.step(runner, only={"b"})  # "a" is dropped by the worker and waits
    assert "a" not in runner.states
    assert scheduler.run(runner) == expected


def test_seeded_sampling_reproducible_across_batches(model_dir: pathlib.Path) -> None:
    seeded = SamplingParams(temperature=1.0, seed=123, max_tokens=10)
    alone = ToyScheduler()
    alone.add("s", PROMPTS["a"], seeded)
    expected = alone.run(make_runner(model_dir))["s"]
    crowded = ToyScheduler(chunk_size=7)
    for request_id, prompt in PROMPTS.items():
        crowded.add(request_id, prompt, SamplingParams(temperature=1.0, max_tokens=10))
    crowded.add("s", PROMPTS["a"], seeded)
    runner = make_runner(model_dir)
    warm = ToyScheduler(first_block=200)  # advance the shared generator first: it must not matter
    warm.add("w", PROMPTS["b"], SamplingParams(temperature=1.0, max_tokens=3))
    warm.run(runner)
    assert crowded.run(runner)["s"] == expected
    preempted = ToyScheduler()
    preempted.add("s", PROMPTS["a"], seeded)
    for _ in range(4):
        preempted.step(runner)
    preempted.preempt("s")
    assert preempted.run(runner)["s"] == expected


def test_finished_requests_are_dropped_and_logprobs_returned(runner: ModelRunner) -> None:
    scheduler = ToyScheduler()
    scheduler.add("a", PROMPTS["a"], SamplingParams(temperature=0.0, max_tokens=2, logprobs=3))
    output = runner.execute(scheduler.schedule())
    assert len(output.logprobs["a"]) == 1 and output.logprobs["a"][0].rank == 1
    assert len(output.logprobs["a"][0].top_token_ids) == 3
    runner.execute(SchedulerOutput([], CachedRequestData(), {}, 0, finished_req_ids={"a"}))
    assert runner.states == {}


def test_unknown_cached_request_and_bad_ranges_raise(runner: ModelRunner) -> None:
    with pytest.raises(KeyError, match="does not hold"):
        runner.execute(SchedulerOutput([], CachedRequestData(["x"], [[]], [0]), {"x": 1}, 1))
    scheduler = ToyScheduler()
    scheduler.add("a", PROMPTS["a"], GREEDY)
    good = scheduler.schedule()
    bad = SchedulerOutput(good.scheduled_new_reqs, CachedRequestData(), {"a": 40}, 40)
    with pytest.raises(ValueError, match="known tokens"):
        runner.execute(bad)


def test_logprobs_are_the_raw_model_distribution(runner: ModelRunner) -> None:
    calls = record_logits(runner)
    scheduler = ToyScheduler()
    params = SamplingParams(temperature=0.7, seed=3, logprobs=4, repetition_penalty=1.5, max_tokens=1)
    scheduler.add("a", PROMPTS["a"], params)
    output = runner.execute(scheduler.schedule())
    entry = output.logprobs["a"][0]
    raw = torch.log_softmax(calls[0][0], dim=-1)
    assert entry.token_id == output.sampled_token_ids["a"][0]
    assert entry.logprob == pytest.approx(raw[entry.token_id].item(), abs=1e-5)
    assert entry.top_token_ids == raw.topk(4).indices.tolist()
    assert entry.rank == int((raw >= raw[entry.token_id]).sum())


def test_profile_run_leaves_cache_and_states_alone(runner: ModelRunner) -> None:
    scheduler = ToyScheduler()
    scheduler.add("a", PROMPTS["a"], GREEDY)
    scheduler.step(runner)
    before = [cache.clone() for cache in runner.kv_caches]
    stages: list[int] = []
    # max_num_batched_tokens on scratch KV (CUDA sizing calls it); the stages: forward, LM head, sampler
    scratch_bytes = runner.profile_run(lambda: stages.append(len(stages)))
    assert stages == [0, 1, 2]
    spec = runner.kv_cache_spec  # the scratch holds the step's tokens, whole blocks per sequence
    assert scratch_bytes >= runner.scheduler_config.max_num_batched_tokens // spec.block_size * spec.bytes_per_block
    assert list(runner.states) == ["a"]
    assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_caches))
