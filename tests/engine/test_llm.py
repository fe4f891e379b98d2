"""Offline LLM.generate over fakes (in-process core, no sockets): input order, prompt forms, kwargs →
config, the in-flight cap respected, stop strings finished in the core, queue timeouts, validation."""

from __future__ import annotations

import json
import pathlib
import time

import pytest
from engine_fakes import ByteTokenizer, FakeScheduler, make_fake_core

from conveyor.config import (
    Batching,
    ConfigError,
    EngineConfig,
    ModelConfig,
    Quantization,
    SchedulerConfig,
    SpeculativeConfig,
)
from conveyor.engine.llm import LLM, engine_config_from_kwargs
from conveyor.engine.types import RequestRejectedError
from conveyor.request import FinishReason
from conveyor.sampling_params import SamplingParams


def make_llm(scheduler: FakeScheduler | None = None, config: EngineConfig | None = None) -> LLM:
    return LLM.from_core(make_fake_core(config, scheduler=scheduler), ByteTokenizer(), config)


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


def test_in_flight_cap_holds_requests_back_without_losing_any() -> None:
    scheduler = FakeScheduler(max_running=4)
    llm = make_llm(scheduler, EngineConfig(scheduler=SchedulerConfig(max_num_queued_reqs=2)))
    results = llm.generate([str(i) for i in range(5)], SamplingParams(max_tokens=3))
    assert [len(r.output_token_ids) for r in results] == [3] * 5
    assert llm.last_run.max_num_running == 2  # never more than the cap in the core at once


def test_stop_string_is_finished_in_the_core_within_the_step() -> None:
    scheduler = FakeScheduler()
    result = make_llm(scheduler).generate("x", SamplingParams(max_tokens=50, stop=("cde",)))[0]
    assert result.text == "ab" and result.finish_reason is FinishReason.STOP
    assert len(result.output_token_ids) == 5 and not scheduler.has_unfinished_requests()
    assert result.timings.finished_s is not None  # the core's finish (timings) reached the result


def test_queue_timeout_result_has_its_error_message() -> None:
    now = [time.monotonic()]  # the LLM stamps arrivals with time.monotonic()
    scheduler = FakeScheduler(max_running=1, queue_timeout_s=2.0, clock=lambda: now[0])
    llm = make_llm(scheduler, EngineConfig(scheduler=SchedulerConfig(queue_timeout_s=2.0)))
    real_step = llm.core.step

    def step():  # time passes between steps
        now[0] += 1.0
        return real_step()

    llm.core.step = step
    results = llm.generate(["a", "b"], SamplingParams(max_tokens=5))
    assert results[1].finish_reason is FinishReason.QUEUE_TIMEOUT
    assert results[1].error_message == "request waited longer than --queue-timeout=2.0s in the queue"


def test_a_prompt_that_cannot_fit_is_refused_before_anything_runs() -> None:
    llm = make_llm(config=EngineConfig(scheduler=SchedulerConfig(max_model_len=10)))
    with pytest.raises(RequestRejectedError) as info:
        llm.generate(["ok", "x" * 20], SamplingParams(max_tokens=2))
    assert info.value.field == "prompt" and llm.last_run.num_steps == 0


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
    vllm_named = engine_config_from_kwargs(None, kv_cache_dtype="fp8", quantization="fp8", device="cuda")
    assert vllm_named.cache.cache_dtype == "fp8" and vllm_named.model.quantization is Quantization.FP8
    with pytest.raises(TypeError, match="bogus"):
        engine_config_from_kwargs(None, bogus=1)


def test_speculative_config_is_taken_as_vllm_spells_it() -> None:
    config = engine_config_from_kwargs(None, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                                 "prompt_lookup_max": 4})
    assert config.speculative_config == SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert engine_config_from_kwargs(config, speculative_config=None).speculative_config is None
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        engine_config_from_kwargs(None, speculative_config={"method": "ngram"})


def test_prompt_dicts_carry_cache_salt_to_the_core() -> None:
    """vLLM's prompt dicts: {"prompt": ...} or {"prompt_token_ids": ...}, with an optional cache_salt."""
    scheduler = FakeScheduler()
    added = []
    add = scheduler.add_request
    scheduler.add_request = lambda request: (added.append(request), add(request))[1]  # type: ignore[method-assign]
    llm = make_llm(scheduler)
    results = llm.generate([{"prompt": "ab", "cache_salt": "run-1"}, {"prompt_token_ids": [5, 6]}, "c"],
                           SamplingParams(max_tokens=2))
    assert [r.prompt_token_ids for r in results] == [llm.tokenizer.encode("ab"), [5, 6], llm.tokenizer.encode("c")]
    assert [request.cache_salt for request in added] == ["run-1", None, None]
    assert len(llm.generate({"prompt": "x", "cache_salt": "s"}, SamplingParams(max_tokens=1))) == 1
    for bad in ({"prompt": "x", "cache_salt": ""}, {"prompt": "x", "prompt_token_ids": [1]}, {"text": "x"},
                {"prompt_token_ids": "x"}):
        with pytest.raises(ValueError):
            llm.generate(bad)
    assert llm.reset_prefix_cache() and scheduler.resets == [False]


def test_default_sampling_params_are_the_models_generation_config(tmp_path: pathlib.Path) -> None:
    """vLLM's LLM.get_default_sampling_params(): what generate() samples with when given no params."""
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9,
                                                                 "max_new_tokens": 3}))
    llm = make_llm(config=EngineConfig(model=ModelConfig(model=str(tmp_path))))
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.max_tokens) == (0.6, 0.9, 3)
    assert [len(r.output_token_ids) for r in llm.generate(["a", "b"])] == [3, 3]
    assert make_llm().get_default_sampling_params() == SamplingParams()
    vllm = engine_config_from_kwargs(None, model=str(tmp_path), generation_config="vllm",
                                     override_generation_config={"temperature": 0.2, "do_sample": True})
    assert make_llm(config=vllm).get_default_sampling_params() == SamplingParams(temperature=0.2)
