"""OutputProcessor: logprobs with token strings, cached-token counts, error messages, stats once."""

from __future__ import annotations

from engine_fakes import ByteTokenizer

from conveyor.core.outputs import EngineCoreOutput, TokenLogprobs
from conveyor.engine.output_processor import OutputProcessor
from conveyor.request import FinishReason, RequestTimings
from conveyor.sampling_params import SamplingParams


def test_logprobs_carry_token_strings() -> None:
    tok = ByteTokenizer()
    processor = OutputProcessor(tok, queue_timeout_s=None)
    processor.add_request("r", [5], SamplingParams(logprobs=2), arrival_s=0.0)
    a, b = ord("a") + 1, ord("b") + 1
    lp = TokenLogprobs(token_id=a, logprob=-0.1, rank=1, top_token_ids=[a, b], top_logprobs=[-0.1, -2.5])
    out = processor.process([EngineCoreOutput("r", [a], new_logprobs=[lp])]).request_outputs[0]
    entry = out.new_logprobs[0]
    assert (entry.token, entry.token_id, entry.logprob) == ("a", a, -0.1)
    assert entry.top == [("a", -0.1), ("b", -2.5)]


def test_finish_carries_stats_and_cached_tokens() -> None:
    processor = OutputProcessor(ByteTokenizer(), queue_timeout_s=None)
    processor.add_request("r", [5, 6], SamplingParams(), arrival_s=1.0)
    timings = RequestTimings(arrival_s=1.0, finished_s=2.0)
    result = processor.process([EngineCoreOutput("r", [98], finish_reason=FinishReason.LENGTH, timings=timings,
                                                 num_prompt_tokens=2, num_cached_tokens=16, num_preemptions=1)])
    out, stats = result.request_outputs[0], result.finished_stats[0]
    assert out.finished and out.num_cached_tokens == 16 and out.prompt_token_ids == [5, 6]
    assert (stats.request_id, stats.num_generation_tokens, stats.num_preemptions) == ("r", 1, 1)
    assert stats.timings is timings and not processor.has_request("r")
    assert processor.process([EngineCoreOutput("r", [], finish_reason=FinishReason.ABORT)]).request_outputs == []


def test_error_outputs_for_crash() -> None:
    processor = OutputProcessor(ByteTokenizer(), queue_timeout_s=None)
    processor.add_request("r", [5], SamplingParams(), arrival_s=0.0)
    (out,) = processor.fail_all("boom")
    assert out.finish_reason is FinishReason.ERROR and out.error_message == "boom" and out.prompt_token_ids == [5]
    assert processor.num_requests == 0
