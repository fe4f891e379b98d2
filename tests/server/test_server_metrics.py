"""/metrics: vLLM 0.32's families (names, types, labels, buckets), vLLM's Grafana dashboard, the names the
benchmark reads, and values fed from the engine's stats."""

from __future__ import annotations

import hashlib
import json
import pathlib
import re

from fake_engine import FakeEngine, FakeEngineConfig
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import app_client, run

from conveyor.engine.types import EngineInfo, FinishedRequestStats, GenerateRequest, IterationStats, SchedulerStats
from conveyor.request import FinishReason, RequestTimings
from conveyor.sampling_params import SamplingParams
from conveyor.server.host_metrics import GpuReading, Nvml
from conveyor.server.metrics import ServerMetrics, build_1_2_5_buckets

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
BENCH = pathlib.Path(__file__).resolve().parents[2] / "src" / "conveyor" / "bench"
VLLM_FAMILIES = json.loads((FIXTURES / "vllm_0_32_metric_families.json").read_text())
"""Scraped from `vllm serve` 0.32 (CPU, SmolLM2, --max-model-len 2048) on this machine: 39 families."""
DASHBOARD = json.loads((FIXTURES / "vllm_grafana_dashboard_queries.json").read_text())
INFO = EngineInfo("m", max_model_len=2048, block_size=16, num_kv_blocks=8, vocab_size=100, config={})


def families(text: str) -> dict:
    return {family.name: family for family in text_string_to_metric_families(text)}


def sample(text: str, metric: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == metric and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(metric)


def label_names(family) -> set[str]:  # noqa: ANN001 - a prometheus_client Metric
    return {key for s in family.samples for key in s.labels if key not in ("le", "quantile")}


def test_every_vllm_0_32_family_with_its_type_labels_and_buckets() -> None:
    found = families(ServerMetrics(INFO).render().decode())
    assert len(VLLM_FAMILIES) == 39
    for expected in VLLM_FAMILIES:
        name = expected["name"]
        assert name in found, name
        assert found[name].type == expected["type"], name
        assert label_names(found[name]) == set(expected["labels"]), name
        for label, values in expected.get("label_values", {}).items():
            assert set(values) <= {s.labels[label] for s in found[name].samples}, (name, label)
        if "buckets" in expected:
            bounds = [s.labels["le"] for s in found[name].samples if s.name.endswith("_bucket")]
            assert bounds == expected["buckets"] + ["+Inf"], name


def test_engine_label_on_every_per_engine_family() -> None:
    found = families(ServerMetrics(INFO).render().decode())
    for name, family in found.items():
        if name.startswith("vllm:") and not name.startswith("vllm:admission_rejections"):
            assert all(s.labels.get("engine") == "0" for s in family.samples), name
    assert "process_resident_memory_bytes" in found and "python_gc_objects_collected" in found


def test_vllm_grafana_dashboard_panels_all_have_data() -> None:
    """Every metric every panel of vLLM's dashboard queries has a series for the served model once a request
    ran (so no panel is empty), and the dashboard's model_name variable finds it."""
    async def main() -> None:
        async with app_client(FakeEngine(FakeEngineConfig(token_delay_s=0.001))) as client:
            await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3})
            text = (await client.get("/metrics")).text
        series = {(s.name, s.labels.get("model_name")) for f in text_string_to_metric_families(text) for s in f.samples}
        assert len(DASHBOARD["panels"]) == 12
        for panel in DASHBOARD["panels"]:
            for expr in panel["exprs"]:
                for metric in re.findall(r"vllm:[a-zA-Z0-9_:]+", expr):
                    assert (metric, "fake-model") in series, (panel["title"], metric)
    run(main())


def bench_names() -> set[str]:
    """Every `conveyor:` name the benchmark's sources quote (what it reads from /metrics)."""
    return {m for path in BENCH.rglob("*.py") for m in re.findall(r"[\"'](conveyor:[a-z_]+)[\"']", path.read_text())}


class FakeNvml(Nvml):
    def read(self) -> GpuReading | None:
        return GpuReading(used_bytes=3e9, utilization=0.25, names=("NVIDIA H200", "NVIDIA H200"), total_bytes=2.8e11)


def test_every_name_the_benchmark_reads_is_exported() -> None:
    names = bench_names()
    assert {"conveyor:gpu_memory_peak_bytes", "conveyor:tokenization_time_seconds", "conveyor:model_info"} <= names
    metrics = ServerMetrics(INFO, nvml=FakeNvml())
    metrics.start()
    assert metrics.model_info.done.wait(10)
    found = families(metrics.render().decode())
    assert names - set(found) == set()
    text = metrics.render().decode()
    assert sample(text, "conveyor:gpu_utilization_perc") == 0.25
    assert sample(text, "conveyor:gpu_memory_used_bytes") == 3e9
    assert sample(text, "conveyor:gpu_info", name="NVIDIA H200", count="2", memory_total_bytes="280000000000") == 1


def test_gpu_info_without_nvml_is_the_engines_device() -> None:
    class NoNvml(Nvml):
        def read(self) -> GpuReading | None:
            return None

    info = EngineInfo("m", max_model_len=64, block_size=16, num_kv_blocks=8, vocab_size=100, config={},
                      device_name="cpu")
    text = ServerMetrics(info, nvml=NoNvml()).render().decode()
    assert sample(text, "conveyor:gpu_info", name="cpu", count="0") == 1
    assert "conveyor:gpu_memory_used_bytes" not in text and "conveyor:gpu_utilization_perc" not in text


def test_model_info_has_the_file_digests(tmp_path: pathlib.Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"gguf bytes")
    info = EngineInfo("m", max_model_len=64, block_size=16, num_kv_blocks=8, vocab_size=100,
                      config={"dtype": "auto", "revision": "none"}, model_path=str(model), dtype="bfloat16")
    metrics = ServerMetrics(info)
    metrics.start()
    assert metrics.model_info.done.wait(10)
    labels = families(metrics.render().decode())["conveyor:model_info"].samples[0].labels
    digest = hashlib.sha256(b"gguf bytes").hexdigest()
    assert labels["weights_sha256"] == labels["config_sha256"] == labels["tokenizer_sha256"] == digest
    assert labels["model_path"] == str(model) and labels["dtype"] == "bfloat16" and labels["revision"] == "unknown"


def test_vllm_buckets() -> None:
    text = ServerMetrics(FakeEngine().info).render().decode()
    ttft = [s.labels["le"] for s in families(text)["vllm:time_to_first_token_seconds"].samples if "le" in s.labels]
    assert ttft[:3] == ["0.001", "0.005", "0.01"] and ttft[-2:] == ["2560.0", "+Inf"]
    fine = [s.labels["le"] for s in families(text)["conveyor:request_queue_time_seconds"].samples if "le" in s.labels]
    assert float(fine[0]) < 0.3  # finer than vLLM's lowest queue-time bucket
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]


def test_counters_agree_with_responses() -> None:
    async def main() -> None:
        async with app_client(FakeEngine(FakeEngineConfig(token_delay_s=0.001))) as client:
            total = 0
            for max_tokens in (1, 3, 7):
                body = (await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": max_tokens})).json()
                total += body["usage"]["completion_tokens"]
            body = (await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "n": 3})).json()
            total += body["usage"]["completion_tokens"]
            text = (await client.get("/metrics")).text
            assert sample(text, "vllm:generation_tokens_total") == total == 11 + 6
            assert sample(text, "vllm:prompt_tokens_total") == 6 * 4
            assert sample(text, "vllm:request_success_total", finished_reason="length") == 6
            assert sample(text, "vllm:e2e_request_latency_seconds_count") == 6
            assert sample(text, "vllm:inter_token_latency_seconds_count") == 0 + 2 + 6 + 3 * 1
            assert sample(text, "vllm:request_generation_tokens_sum") == 17
            assert sample(text, "vllm:request_params_n_count") == 4 and sample(text, "vllm:request_params_n_sum") == 6
            assert sample(text, "vllm:request_params_max_tokens_sum") == 1 + 3 + 7 + 3 * 2
            assert sample(text, "vllm:request_max_num_generation_tokens_sum") == 1 + 3 + 7 + 2
            assert sample(text, "vllm:num_requests_running") == 0
            assert sample(text, "vllm:kv_cache_usage_perc") == 0
    run(main())


def test_intervals_follow_vllm_definitions() -> None:
    metrics = ServerMetrics(INFO)
    timings = RequestTimings(arrival_s=10.0, first_scheduled_s=10.5, first_token_s=11.0, last_token_s=13.0,
                             finished_s=13.25, token_times_s=[11.0, 12.0, 13.0])
    finished = FinishedRequestStats(FinishReason.STOP, timings, num_prompt_tokens=5, num_generation_tokens=3,
                                    num_cached_tokens=2, num_preemptions=1)
    stats = SchedulerStats(num_running_reqs=1, num_waiting_reqs=2, kv_cache_usage=0.5, num_preemptions=1,
                           prefix_cache_queries=16, prefix_cache_hits=8, num_scheduled_tokens=40,
                           num_generation_tokens=1, num_queue_timeouts=1)
    metrics.on_step(IterationStats(stats, [finished], peak_memory_bytes=2**30))
    text = metrics.render().decode()
    assert sample(text, "vllm:request_queue_time_seconds_sum") == 0.5
    assert sample(text, "conveyor:request_queue_time_seconds_sum") == 0.5
    assert sample(text, "conveyor:request_queue_time_seconds_bucket", le="0.5") == 1
    assert sample(text, "conveyor:request_queue_time_seconds_bucket", le="0.3") == 0
    assert sample(text, "vllm:request_prefill_time_seconds_sum") == 0.5
    assert sample(text, "vllm:request_decode_time_seconds_sum") == 2.0
    assert sample(text, "vllm:request_time_per_output_token_seconds_sum") == 1.0  # 2 s over 2 tokens after the first
    assert sample(text, "vllm:time_to_first_token_seconds_sum") == 1.0
    assert sample(text, "vllm:e2e_request_latency_seconds_sum") == 3.25
    assert sample(text, "vllm:inter_token_latency_seconds_sum") == 2.0
    assert sample(text, "vllm:time_per_output_token_seconds_count") == 2
    assert sample(text, "vllm:request_inference_time_seconds_sum") == 2.5
    assert sample(text, "vllm:iteration_tokens_total_sum") == 40
    assert sample(text, "vllm:request_num_preemptions_sum") == 1
    assert sample(text, "vllm:request_prefill_kv_computed_tokens_sum") == 3
    assert sample(text, "vllm:prompt_tokens_cached_total") == 2
    assert sample(text, "vllm:prompt_tokens_by_source_total", source="local_compute") == 3
    assert sample(text, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") == 2
    assert sample(text, "vllm:prompt_tokens_cached_by_source_total", source="device") == 8
    assert sample(text, "vllm:num_requests_waiting") == 2 and sample(text, "vllm:kv_cache_usage_perc") == 0.5
    assert sample(text, "vllm:num_requests_waiting_by_reason", reason="capacity") == 2
    assert sample(text, "vllm:engine_sleep_state", sleep_state="awake") == 1
    assert sample(text, "vllm:num_preemptions_total") == 1 and sample(text, "vllm:prefix_cache_hits_total") == 8
    assert sample(text, "conveyor:queue_timeouts_total") == 1
    assert sample(text, "conveyor:gpu_memory_peak_bytes") == 2**30
    assert sample(text, "vllm:request_success_total", finished_reason="stop") == 1


def test_max_tokens_absent_is_what_is_left_of_the_context() -> None:
    metrics = ServerMetrics(INFO)
    request = GenerateRequest("r", [1, 2, 3], SamplingParams(max_tokens=None))
    metrics.track_request([request])
    assert sample(metrics.render().decode(), "vllm:request_params_max_tokens_sum") == 2048 - 3


def test_registries_are_independent() -> None:
    first, second = ServerMetrics(FakeEngine().info), ServerMetrics(FakeEngine().info)
    first.observe_tokenization(0.5)
    assert sample(first.render().decode(), "conveyor:tokenization_time_seconds_count") == 1
    assert sample(second.render().decode(), "conveyor:tokenization_time_seconds_count") == 0
