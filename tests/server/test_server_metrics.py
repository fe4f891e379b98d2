"""/metrics: vLLM's families, types, label and buckets; values fed from the engine's stats."""

from __future__ import annotations

from fake_engine import FakeEngine, FakeEngineConfig
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import app_client, run

from conveyor.engine.types import EngineInfo, FinishedRequestStats, IterationStats, SchedulerStats
from conveyor.request import FinishReason, RequestTimings
from conveyor.server.metrics import ServerMetrics, build_1_2_5_buckets

EXPECTED_TYPES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge",
    "vllm:num_preemptions": "counter",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "conveyor:requests_rejected": "counter",
    "conveyor:queue_timeouts": "counter",
    "conveyor:config_info": "gauge",
    "vllm:admission_rejections": "counter",
    "conveyor:request_tokenization_time_seconds": "histogram",
    "conveyor:engine_peak_memory_bytes": "gauge",
}


def families(text: str) -> dict:
    return {family.name: family for family in text_string_to_metric_families(text)}


def sample(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(name)


def test_families_names_types_and_labels() -> None:
    async def main() -> None:
        async with app_client() as client:
            text = (await client.get("/metrics")).text
            found = families(text)
            for name, kind in EXPECTED_TYPES.items():
                assert name in found, name
                assert found[name].type == kind, name
            for family in found.values():
                assert all(s.labels.get("model_name") == "fake-model" for s in family.samples), family.name
            assert '# TYPE vllm:generation_tokens_total counter' in text
            info = found["conveyor:config_info"].samples[0]
            assert info.value == 1 and info.labels["max_num_seqs"] == "4" and info.labels["num_kv_blocks"] == "64"
    run(main())


def test_vllm_buckets() -> None:
    text = ServerMetrics(FakeEngine().info).render().decode()
    ttft = [s.labels["le"] for s in families(text)["vllm:time_to_first_token_seconds"].samples if "le" in s.labels]
    assert ttft[:3] == ["0.001", "0.005", "0.01"] and ttft[-2:] == ["2560.0", "+Inf"]
    itl = [s.labels["le"] for s in families(text)["vllm:inter_token_latency_seconds"].samples if "le" in s.labels]
    assert itl[0] == "0.01" and itl[-2] == "80.0"
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]


def test_counters_agree_with_responses() -> None:
    async def main() -> None:
        async with app_client(FakeEngine(FakeEngineConfig(token_delay_s=0.001))) as client:
            total = 0
            for max_tokens in (1, 3, 7):
                body = (await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": max_tokens})).json()
                total += body["usage"]["completion_tokens"]
            text = (await client.get("/metrics")).text
            assert sample(text, "vllm:generation_tokens_total") == total == 11
            assert sample(text, "vllm:prompt_tokens_total") == 3 * 4
            assert sample(text, "vllm:request_success_total", finished_reason="length") == 3
            assert sample(text, "vllm:e2e_request_latency_seconds_count") == 3
            assert sample(text, "vllm:inter_token_latency_seconds_count") == 0 + 2 + 6
            assert sample(text, "vllm:request_generation_tokens_sum") == 11
            assert sample(text, "vllm:num_requests_running") == 0
            assert sample(text, "vllm:kv_cache_usage_perc") == 0
    run(main())


def test_intervals_follow_vllm_definitions() -> None:
    info = EngineInfo("m", max_model_len=64, block_size=16, num_kv_blocks=8, vocab_size=100, config={})
    metrics = ServerMetrics(info)
    timings = RequestTimings(arrival_s=10.0, first_scheduled_s=10.5, first_token_s=11.0, last_token_s=13.0,
                             finished_s=13.25, token_times_s=[11.0, 12.0, 13.0])
    finished = FinishedRequestStats(FinishReason.STOP, timings, num_prompt_tokens=5, num_generation_tokens=3,
                                    num_cached_tokens=0, num_preemptions=0)
    stats = SchedulerStats(num_running_reqs=1, num_waiting_reqs=2, kv_cache_usage=0.5, num_preemptions=1,
                           prefix_cache_queries=16, prefix_cache_hits=8, num_scheduled_tokens=40,
                           num_generation_tokens=1, num_queue_timeouts=1)
    metrics.on_step(IterationStats(stats, [finished], peak_memory_bytes=2**30))
    text = metrics.render().decode()
    assert sample(text, "vllm:request_queue_time_seconds_sum") == 0.5
    assert sample(text, "vllm:request_prefill_time_seconds_sum") == 0.5
    assert sample(text, "vllm:request_decode_time_seconds_sum") == 2.0
    assert sample(text, "vllm:time_to_first_token_seconds_sum") == 1.0
    assert sample(text, "vllm:e2e_request_latency_seconds_sum") == 3.25
    assert sample(text, "vllm:inter_token_latency_seconds_sum") == 2.0
    assert sample(text, "vllm:time_per_output_token_seconds_count") == 2
    assert sample(text, "vllm:request_inference_time_seconds_sum") == 2.5
    assert sample(text, "vllm:iteration_tokens_total_sum") == 40
    assert sample(text, "vllm:num_requests_waiting") == 2 and sample(text, "vllm:kv_cache_usage_perc") == 0.5
    assert sample(text, "vllm:num_preemptions_total") == 1 and sample(text, "vllm:prefix_cache_hits_total") == 8
    assert sample(text, "conveyor:queue_timeouts_total") == 1
    assert sample(text, "conveyor:engine_peak_memory_bytes") == 2**30
    assert sample(text, "vllm:request_success_total", finished_reason="stop") == 1


def test_registries_are_independent() -> None:
    first, second = ServerMetrics(FakeEngine().info), ServerMetrics(FakeEngine().info)
    first.count_rejection(next(iter(first.rejected)))
    assert first.render() != second.render()
