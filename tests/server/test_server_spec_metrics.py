"""/metrics under speculative decoding: vLLM's four vllm:spec_decode_* counters, present only when a
--speculative-config is set, with one `position` child per draft position, summed from the steps."""

from __future__ import annotations

import json

from prometheus_client.parser import text_string_to_metric_families

from conveyor.core.stats import SpecDecodingStats
from conveyor.engine.types import EngineInfo, IterationStats, SchedulerStats
from conveyor.server.metrics import ServerMetrics

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4})


def info(speculative_config: str) -> EngineInfo:
    return EngineInfo("m", max_model_len=64, block_size=16, num_kv_blocks=8, vocab_size=1000,
                      config={"speculative-config": speculative_config})


def step(spec: SpecDecodingStats | None) -> SchedulerStats:
    return SchedulerStats(num_running_reqs=1, num_waiting_reqs=0, kv_cache_usage=0.1, spec_decoding=spec)


def samples(text: str, name: str) -> dict[str, float]:
    """position (or '' for unlabelled) -> value of one counter's _total samples."""
    return {s.labels.get("position", ""): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name}


def test_spec_decode_counters_sum_the_steps_per_position() -> None:
    metrics = ServerMetrics(info(NGRAM))
    first = SpecDecodingStats(num_spec_tokens=3)
    first.observe_draft(num_draft_tokens=3, num_accepted_tokens=2)
    first.observe_draft(num_draft_tokens=2, num_accepted_tokens=0)
    second = SpecDecodingStats(num_spec_tokens=3)
    second.observe_draft(num_draft_tokens=3, num_accepted_tokens=3)
    for stats in (step(first), step(None), step(second)):
        metrics.on_step(IterationStats(stats))
    text = metrics.render().decode()
    assert samples(text, "vllm:spec_decode_num_drafts_total") == {"": 3}
    assert samples(text, "vllm:spec_decode_num_draft_tokens_total") == {"": 8}
    assert samples(text, "vllm:spec_decode_num_accepted_tokens_total") == {"": 5}
    per_pos = samples(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total")
    assert per_pos == {"0": 2, "1": 2, "2": 1} and sum(per_pos.values()) == 5


def test_without_speculation_there_are_no_spec_decode_series() -> None:
    text = ServerMetrics(info("none")).render().decode()
    assert "vllm:spec_decode" not in text
    fresh = ServerMetrics(info(NGRAM)).render().decode()  # with it, every series exists from the start
    assert samples(fresh, "vllm:spec_decode_num_accepted_tokens_per_pos_total") == {"0": 0, "1": 0, "2": 0}
