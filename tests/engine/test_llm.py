"""Offline LLM.generate over fakes: input order, prompt forms, kwargs → config, queue bound respected."""

from __future__ import annotations

import pytest
from engine_fakes import ByteTokenizer, FakeScheduler, make_fake_core

from conveyor.config import Batching, EngineConfig
from conveyor.engine.llm import LLM, engine_config_from_kwargs
from conveyor.engine.llm_engine import LLMEngine
from conveyor.request import FinishReason
from conveyor.sampling_params import SamplingParams


def make_llm(scheduler: FakeScheduler | None = None) -> LLM:
    return LLM.from_engine(LLMEngine(make_fake_core(scheduler=scheduler), ByteTokenizer()))


def test_results_in_input_order_with_per_prompt_params() -> None:
    llm = make_llm()
    params = [SamplingParams(max_tokens=n) for n in (7, 2, 5)]
    results = llm.generate(["a", "bb", [5, 6, 7]], params)
    assert [len(r.output_token_ids) for r in results] == [7, 2, 5]
    assert results[2].prompt_token_ids == [5, 6, 7]
    assert results[0].text == "abcdefg" and results[0].finish_reason is FinishReason.LENGTH
    assert all(r.timings.finished_s is not None for r in results)
    assert llm.last_run.num_steps > 0


def test_single_prompt_forms() -> None:
    llm = make_llm()
    assert len(llm.generate("x", SamplingParams(max_tokens=2))) == 1
    assert llm.generate([3, 4], SamplingParams(max_tokens=2))[0].prompt_token_ids == [3, 4]


def test_queue_bound_holds_requests_back_without_losing_any() -> None:
    llm = make_llm(FakeScheduler(max_running=1, max_queued=1))
    results = llm.generate([str(i) for i in range(5)], SamplingParams(max_tokens=3))
    assert [len(r.output_token_ids) for r in results] == [3] * 5


def test_stop_string_result() -> None:
    result = make_llm().generate("x", SamplingParams(max_tokens=20, stop=("de",)))[0]
    assert result.text == "abc" and result.finish_reason is FinishReason.STOP and result.stop_reason == "de"


def test_mismatched_params_length() -> None:
    with pytest.raises(ValueError, match="sampling_params"):
        make_llm().generate(["a", "b"], [SamplingParams()])


def test_kwargs_map_onto_config_fields() -> None:
    config = engine_config_from_kwargs(None, batching="static", max_num_seqs=4, enable_prefix_caching=False,
                                       model="m.gguf", check_invariants=True)
    assert config.scheduler.batching is Batching.STATIC and config.scheduler.max_num_seqs == 4
    assert not config.cache.enable_prefix_caching and config.model.model == "m.gguf" and config.check_invariants
    assert engine_config_from_kwargs(EngineConfig()) == EngineConfig()
    with pytest.raises(TypeError, match="bogus"):
        engine_config_from_kwargs(None, bogus=1)
