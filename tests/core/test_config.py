"""Invalid scheduler and cache configurations fail at construction with a message saying what to change."""

from __future__ import annotations

import pytest

from conveyor.config import CacheConfig, ConfigError, SchedulerConfig


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
