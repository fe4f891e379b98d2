"""Grammars in the engine core (issue 34). A constrained request waits outside the scheduler until the
runner's matcher for it is built (never in a step), and an abort ends it while it waits. A request whose
output can no longer follow its grammar ends as an error that says so: the worker reports it beside the
step's tokens, the engine core ends it before the EOS the worker's mask forced could finish it as a
plain "stop", its KV blocks go back to the pool, and the front end's output names the field (the server
answers 400)."""

from __future__ import annotations

import dataclasses
import time

import pytest

from conveyor.config import CacheConfig, EngineConfig, SchedulerConfig
from conveyor.core.fake_runner import FakeModelRunner
from conveyor.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from conveyor.core.policies import make_scheduler
from conveyor.engine.engine_core import ModelLimits, make_engine_core
from conveyor.engine.output_processor import OutputProcessor
from conveyor.request import FinishReason, Request
from conveyor.sampling_params import GrammarKind, SamplingParams, StructuredOutput

EOS = 2
FAILURE = "guided_regex: the output can no longer follow the grammar: output token 1: lexer error"


class FailingGrammarRunner(FakeModelRunner):
    """The fake runner, whose step `fail_at` reports request "bad"'s grammar failed and samples EOS for it."""

    fail_at: int = 3
    num_steps: int = 0
    message: str | None = FAILURE
    """What the worker reports: None where the engine is at fault (it sampled a token the mask forbade)."""

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        result = super().execute(output)
        self.num_steps += 1
        if self.num_steps != self.fail_at or not result.sampled_token_ids.get("bad"):
            return result
        sampled = {**result.sampled_token_ids, "bad": [EOS]}
        return dataclasses.replace(result, sampled_token_ids=sampled, grammar_errors={"bad": self.message})


@pytest.mark.parametrize("message", [FAILURE, None])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_grammar_failure_ends_the_request_as_an_error_and_frees_its_blocks(async_scheduling: bool,
                                                                             message: str | None) -> None:
    """A message ends it as the request's error (a 400 naming the field); None as an engine error (a 500)."""
    config = EngineConfig(scheduler=SchedulerConfig(max_model_len=64, max_num_batched_tokens=64, max_num_seqs=8,
                                                    async_scheduling=async_scheduling),
                          cache=CacheConfig(block_size=4))
    scheduler = make_scheduler(config.scheduler, config.cache, 32, time.monotonic)
    runner = FailingGrammarRunner(4)
    runner.message = message
    core = make_engine_core(config, runner, scheduler, ModelLimits(32, 64, (EOS,), 1000))
    params = SamplingParams(max_tokens=8, structured_output=StructuredOutput(GrammarKind.REGEX, "a+", "guided_regex"))
    for request_id in ("bad", "good"):
        core.add_request(Request(request_id, [5, 6, 7], params, arrival_s=time.monotonic(), eos_token_id=EOS))
    finished: dict[str, EngineCoreOutput] = {}
    for _ in range(50):
        if not core.has_unfinished_requests():
            break
        finished.update({o.request_id: o for o in core.step().outputs.finished_outputs})
    bad, good = finished["bad"], finished["good"]
    assert bad.finish_reason is FinishReason.ERROR and bad.error_message == message
    assert EOS not in bad.new_token_ids  # the forced EOS is not reported as output
    assert good.finish_reason is FinishReason.LENGTH and good.error_message is None
    assert scheduler.kv_cache_usage == 0


def test_the_front_end_output_names_the_grammar_field() -> None:
    class Decoder:
        def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
            return "".join(chr(96 + t % 26) for t in token_ids)

    processor = OutputProcessor(Decoder(), None)  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=8, structured_output=StructuredOutput(GrammarKind.REGEX, "a+", "guided_regex"))
    processor.add_request("bad", [5, 6], params, 0.0)
    processor.add_request("dead", [5, 6], SamplingParams(max_tokens=8), 0.0)
    outputs = processor.process([EngineCoreOutput("bad", [], finish_reason=FinishReason.ERROR, error_message=FAILURE),
                                 EngineCoreOutput("dead", [], finish_reason=FinishReason.ERROR)])
    bad, dead = outputs.request_outputs
    assert (bad.error_message, bad.error_param) == (FAILURE, "guided_regex")
    assert dead.error_param is None and dead.error_message  # an engine fault: a 500, as before


class FakeGrammars:
    """The runner's matchers as the engine core sees them: built when the test says so."""

    def __init__(self) -> None:
        self.ready: set[str] = set()
        self.prepared: list[str] = []
        self.dropped: list[str] = []
        self.num_waits = 0

    def prepare(self, request_id: str, constraint: StructuredOutput) -> None:
        self.prepared.append(request_id)

    def is_ready(self, request_id: str) -> bool:
        return request_id in self.ready

    def drop(self, request_ids: list[str]) -> None:
        self.dropped.extend(request_ids)

    def wait(self, request_id: str, timeout_s: float) -> None:
        self.num_waits += 1

    def shutdown(self) -> None:
        pass


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_constrained_request_waits_for_its_matcher_while_others_step(async_scheduling: bool) -> None:
    config = EngineConfig(scheduler=SchedulerConfig(max_model_len=64, max_num_batched_tokens=64, max_num_seqs=8,
                                                    async_scheduling=async_scheduling),
                          cache=CacheConfig(block_size=4))
    scheduler = make_scheduler(config.scheduler, config.cache, 32, time.monotonic)
    runner = FakeModelRunner(4)
    grammars = FakeGrammars()
    runner.structured_outputs = grammars  # type: ignore[attr-defined]
    core = make_engine_core(config, runner, scheduler, ModelLimits(32, 64, (EOS,), 1000))
    constrained = SamplingParams(max_tokens=4, structured_output=StructuredOutput(GrammarKind.CHOICE, '["a"]'))
    for request_id, params in (("slow", constrained), ("gone", constrained), ("plain", SamplingParams(max_tokens=4))):
        core.add_request(Request(request_id, [5, 6, 7], params, arrival_s=time.monotonic(), eos_token_id=EOS))
    assert grammars.prepared == ["slow", "gone"]
    finished: dict[str, EngineCoreOutput] = {}
    for _ in range(20):  # the plain request runs to its end while the grammars are still building
        result = core.step()
        finished.update({o.request_id: o for o in result.outputs.finished_outputs})
    assert result.stats.num_waiting_reqs == 2  # waiting for a matcher counts as waiting, as in vLLM
    assert set(finished) == {"plain"} and core.has_unfinished_requests()
    assert not scheduler.has_unfinished_requests()  # the waiting ones never reached the scheduler
    assert grammars.num_waits > 0  # with nothing else to run, a step blocks on the build, not spins
    aborted = core.abort(["gone"])
    assert [(o.request_id, o.finish_reason) for o in aborted] == [("gone", FinishReason.ABORT)]
    assert grammars.dropped == ["gone"]
    grammars.ready.add("slow")
    for _ in range(20):
        if not core.has_unfinished_requests():
            break
        finished.update({o.request_id: o for o in core.step().outputs.finished_outputs})
    assert finished["slow"].finish_reason is FinishReason.LENGTH and not core.has_unfinished_requests()
    assert scheduler.kv_cache_usage == 0
