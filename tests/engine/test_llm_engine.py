"""LLMEngine over a fake scheduler/runner: text, stop strings, validation, aborts, queue timeouts."""

from __future__ import annotations

import pytest
from engine_fakes import ByteTokenizer, FakeRunner, FakeScheduler, make_fake_core

from conveyor.config import EngineConfig, SchedulerConfig
from conveyor.engine.llm_engine import LLMEngine, RequestLimits, validate_prompt
from conveyor.engine.types import EngineOverloadedError, GenerateRequest, RequestOutput, RequestRejectedError
from conveyor.request import FinishReason
from conveyor.sampling_params import SamplingParams


def make_engine(**kwargs) -> LLMEngine:
    return LLMEngine(make_fake_core(**kwargs), ByteTokenizer())


def run_all(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step().request_outputs:
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def add(engine: LLMEngine, request_id: str, prompt: str | list[int], **params) -> None:
    engine.add_request(engine.prepare(GenerateRequest(request_id, prompt, SamplingParams(**params))))


def test_text_counts_and_first_output_carries_prompt() -> None:
    engine = make_engine()
    add(engine, "a", "hi", max_tokens=5, temperature=0)
    outs = run_all(engine)["a"]
    assert "".join(o.new_text for o in outs) == "abcde"
    assert [o.num_output_tokens for o in outs] == [1, 2, 3, 4, 5]
    assert outs[0].prompt_token_ids == ByteTokenizer().encode("hi") and outs[1].prompt_token_ids == []
    assert outs[-1].finish_reason is FinishReason.LENGTH and all(not o.finished for o in outs[:-1])


def test_stop_string_ends_request_with_stop_and_frees_it_in_the_scheduler() -> None:
    scheduler = FakeScheduler()
    engine = LLMEngine(make_fake_core(scheduler=scheduler), ByteTokenizer())
    add(engine, "a", "hi", max_tokens=50, stop=("cde",))
    outs = run_all(engine)["a"]
    final = outs[-1]
    assert final.finish_reason is FinishReason.STOP and final.stop_reason == "cde"
    assert "".join(o.new_text for o in outs) == "ab"
    assert final.num_output_tokens == 5
    assert not scheduler.has_unfinished_requests()


def test_stop_strings_stats_come_once() -> None:
    engine = make_engine()
    add(engine, "a", "hi", max_tokens=50, stop=("c",))
    stats = []
    while engine.has_unfinished_requests():
        stats.extend(engine.step().finished_stats)
    assert [s.finish_reason for s in stats] == [FinishReason.STOP]
    assert stats[0].num_generation_tokens == 3


def test_abort_gives_final_abort_output() -> None:
    engine = make_engine()
    add(engine, "a", "hi", max_tokens=50)
    engine.step()
    engine.abort(["a", "unknown"])
    step = engine.step()
    assert [o.finish_reason for o in step.request_outputs] == [FinishReason.ABORT]
    assert [s.finish_reason for s in step.finished_stats] == [FinishReason.ABORT]
    assert not engine.has_unfinished_requests()


def test_queue_timeout_output_has_error_message() -> None:
    now = [0.0]
    scheduler = FakeScheduler(max_running=1, queue_timeout_s=2.0, clock=lambda: now[0])
    config = EngineConfig(scheduler=SchedulerConfig(queue_timeout_s=2.0))
    engine = LLMEngine(make_fake_core(config, scheduler=scheduler), ByteTokenizer())
    engine.add_request(engine.prepare(GenerateRequest("a", "x", SamplingParams(max_tokens=50))), arrival_s=0.0)
    engine.add_request(engine.prepare(GenerateRequest("b", "x", SamplingParams(max_tokens=50))), arrival_s=0.0)
    engine.step()
    now[0] = 3.0
    outs = [o for o in engine.step().request_outputs if o.request_id == "b"]
    assert outs[0].finish_reason is FinishReason.QUEUE_TIMEOUT
    assert outs[0].error_message == "request waited longer than --queue-timeout=2.0s in the queue"


def test_queue_full_maps_to_overloaded() -> None:
    engine = LLMEngine(make_fake_core(scheduler=FakeScheduler(max_queued=1)), ByteTokenizer())
    add(engine, "a", "x")
    with pytest.raises(EngineOverloadedError):
        add(engine, "b", "x")


def test_duplicate_request_id_rejected() -> None:
    engine = make_engine()
    add(engine, "a", "x")
    with pytest.raises(RequestRejectedError) as info:
        add(engine, "a", "x")
    assert info.value.field == "request_id"


@pytest.mark.parametrize(("prompt_len", "max_tokens", "field"), [
    (0, 4, "prompt"), (11, 1, "prompt"), (10, None, "prompt"), (8, 3, "max_tokens")])
def test_length_validation_names_the_field(prompt_len: int, max_tokens: int | None, field: str) -> None:
    with pytest.raises(RequestRejectedError) as info:
        validate_prompt([1] * prompt_len, SamplingParams(max_tokens=max_tokens), RequestLimits(10, 100))
    assert info.value.field == field
    if field == "max_tokens":
        assert "max_model_len=10" in str(info.value)


def test_out_of_vocab_token_rejected() -> None:
    with pytest.raises(RequestRejectedError, match="out of range"):
        validate_prompt([5, 100], SamplingParams(), RequestLimits(10, 100))


def test_fits_exactly() -> None:
    validate_prompt([1] * 8, SamplingParams(max_tokens=2), RequestLimits(10, 100))


def test_runner_skipped_when_nothing_scheduled() -> None:
    runner = FakeRunner()
    engine = LLMEngine(make_fake_core(runner=runner), ByteTokenizer())
    engine.step()
    assert runner.num_executes == 0
