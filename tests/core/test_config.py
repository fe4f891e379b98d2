"""Invalid scheduler and cache configurations fail at construction with a message saying what to change."""

from __future__ import annotations

import pytest

from conveyor.config import CacheConfig, ConfigError, EngineConfig, SchedulerConfig, SpeculativeConfig, SpeculativeMethod


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_num_seqs": 0}, "max_num_seqs must be >= 1"),
    ({"max_num_batched_tokens": 4, "max_num_seqs": 8}, "raise --max-num-batched-tokens or lower --max-num-seqs"),
    ({"enable_chunked_prefill": False, "max_num_batched_tokens": 512, "max_model_len": 1024},
     "enable chunked prefill"),
    ({"long_prefill_token_threshold": 0}, "long_prefill_token_threshold must be >= 1"),
    ({"max_num_queued_reqs": 0}, "max_num_queued_reqs must be >= 1"),
    ({"queue_timeout_s": 0.0}, "queue_timeout_s must be > 0"),
    ({"max_model_len": 0}, "max_model_len must be >= 1"),
])
def test_scheduler_config_rejects(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SchedulerConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("block_size", [0, 3, 12, -16])
def test_block_size_must_be_a_power_of_two(block_size: int) -> None:
    with pytest.raises(ConfigError, match="block_size must be a positive power of two"):
        CacheConfig(block_size=block_size)


def test_config_errors_are_value_errors() -> None:
    assert issubclass(ConfigError, ValueError)
    assert SchedulerConfig().max_num_batched_tokens >= SchedulerConfig().max_num_seqs


def ngram(**keys: object) -> SpeculativeConfig:
    return SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, **keys})


def test_ngram_lookup_bounds_follow_vllm_defaults() -> None:
    assert (ngram().prompt_lookup_min, ngram().prompt_lookup_max) == (5, 5)
    assert (ngram(prompt_lookup_max=3).prompt_lookup_min, ngram(prompt_lookup_max=3).prompt_lookup_max) == (3, 3)
    assert (ngram(prompt_lookup_min=2).prompt_lookup_min, ngram(prompt_lookup_min=2).prompt_lookup_max) == (2, 2)
    assert ngram().num_lookahead_tokens == 0


def test_draft_model_config_and_method_inference() -> None:
    spec = SpeculativeConfig.from_dict({"model": "draft.gguf", "num_speculative_tokens": 4})
    assert spec.method is SpeculativeMethod.DRAFT_MODEL and spec.num_lookahead_tokens == 4
    assert SpeculativeConfig.from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize(("keys", "message"), [
    ({"method": "medusa", "num_speculative_tokens": 3}, "'method' 'medusa' is a vLLM method conveyor does not have"),
    ({"method": "lookup", "num_speculative_tokens": 3}, "unknown 'method' 'lookup'"),
    ({"num_speculative_tokens": 3}, "'method' is required"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup": 2}, "unknown key 'prompt_lookup'"),
    ({"method": "ngram", "num_speculative_tokens": 129}, "'num_speculative_tokens' must be in 1..128"),
    ({"method": "ngram", "num_speculative_tokens": True}, "'num_speculative_tokens' must be an integer"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 0}, "'prompt_lookup_min' must be >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "'prompt_lookup_min' \\(4\\) must be <= 'prompt_lookup_max' \\(2\\)"),
    ({"method": "ngram", "num_speculative_tokens": 3, "model": "x.gguf"}, "'model' is for method draft_model"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "method draft_model needs 'model'"),
    ({"method": "draft_model", "num_speculative_tokens": 3, "model": "x", "prompt_lookup_max": 2},
     "'prompt_lookup_max' is for method ngram"),
    ({"method": "draft_model", "num_speculative_tokens": 3, "model": 5}, "'model' must be a string"),
])
def test_bad_speculative_configs_name_the_key(keys: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SpeculativeConfig.from_dict(keys)


def test_speculative_decoding_and_async_scheduling_are_refused_together() -> None:
    with pytest.raises(ConfigError, match="cannot run with async_scheduling"):
        EngineConfig(scheduler=SchedulerConfig(async_scheduling=True), speculative_config=ngram())
    assert EngineConfig(speculative_config=ngram()).speculative_config == ngram()
