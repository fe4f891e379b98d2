"""summary.json as a typed RunSummary: every run directory on record loads, round-trips, and fails clearly."""

from __future__ import annotations

import json
import math
import pathlib

import pytest

from conveyor.bench.jsonvalue import JSON
from conveyor.bench.measure.rundirs import RunDirError, load_run
from conveyor.bench.measure.summary import summary_from_json, summary_to_json

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures"
SUMMARIES = sorted(FIXTURES.rglob("summary.json"))


def _same(written: JSON, read_back: JSON) -> bool:
    """Equal as JSON, a key the file lacks (a default the typed record fills in) aside."""
    if isinstance(written, dict) and isinstance(read_back, dict):
        return all(k in read_back and _same(v, read_back[k]) for k, v in written.items())
    if isinstance(written, float) and isinstance(read_back, float) and math.isnan(written):
        return math.isnan(read_back)
    return written == read_back


@pytest.mark.parametrize("path", SUMMARIES, ids=lambda p: str(p.relative_to(FIXTURES)))
def test_every_recorded_summary_round_trips(path: pathlib.Path) -> None:
    data = json.loads(path.read_text())
    summary = summary_from_json(data, path.parent.name, str(path))
    assert _same(data, summary_to_json(summary))
    again = summary_from_json(summary_to_json(summary), path.parent.name, str(path))
    assert summary_to_json(again) == summary_to_json(summary)


def test_the_fixtures_are_runs_written_before_the_typed_record() -> None:
    assert len(SUMMARIES) >= 30
    assert all("ci" not in json.loads(p.read_text()) for p in SUMMARIES)  # older than the intervals, too


FULL: dict[str, JSON] = {
    "schema_version": 1, "label": "c@2#0", "base_url": "http://h:1", "model": "m", "endpoint": "completions",
    "temperature": None, "trace_path": "t.jsonl", "trace_version": "1", "request_rate": "inf", "burstiness": 1.0,
    "arrival": "poisson", "profile": None, "max_concurrency": 4, "seed": 0, "started_at": "2026-12-06T00:00:00+00:00",
    "num_prompts": 10, "completed": 9, "failed": 1, "cancelled": 0, "duration": 5.0, "total_input_tokens": 100,
    "total_output_tokens": 90, "request_throughput": 1.8, "output_throughput": 18.0, "total_token_throughput": 38.0,
    "p95_ttft_ms": 120.0, "median_e2el_ms": None, "slo": {"ttft_ms": 500.0, "tpot_ms": None}, "goodput": 1.6,
    "error_rate": 0.1, "errors_by_kind": {"http_503": 1},
    "per_class": {"chat": {"num_prompts": 10, "completed": 9, "failed": 1, "cancelled": 0,
                           "request_throughput": 1.8, "output_throughput": 18.0, "p95_ttft_ms": 120.0,
                           "error_rate": 0.1, "ci": {"p95_ttft_ms": {"estimate": 120.0, "low": 100.0, "high": "inf",
                                                                     "confidence": 0.95, "method": "bootstrap over requests", "n": 9}}}},
    "num_sent": 12, "window": {"num_warmup": 2, "label": "steady state"}, "client": {"num_workers": 1, "json": "orjson"},
    "num_sessions": 2, "per_turn": {"1": {"num_prompts": 5, "completed": 5, "failed": 0, "cancelled": 0,
                                          "request_throughput": 1.0, "output_throughput": 9.0, "error_rate": 0.0,
                                          "mean_prompt_tokens": 10.5}},
    "send_lag_p99_ms": 0.4, "max_send_lag_p99_ms": 10.0, "valid": False, "invalid_reason": "client CPU",
    "invalid_reasons": ["client CPU"], "client_cpu_utilization": 0.95, "num_client_side_errors": 0,
    "server": {"available": True, "queue_time_p95_ms": 3.0, "queue_time_histogram": "vllm:request_queue_time_seconds",
               "queue_time_buckets": [[0.1, 5.0], ["inf", 9.0]], "queue_time_p95_bucket_ms": [0.0, 100.0],
               "spec_decode_acceptance_rate_per_pos": [0.8, 0.5], "gpu_memory_source": None,
               "ci": {"queue_time_p95_ms": {"estimate": 3.0, "low": 0.0, "high": 100.0, "confidence": 0.95,
                                            "method": "histogram bucket", "n": 9}}},
    "ci": {"request_throughput": {"estimate": 1.8, "low": 1.5, "high": 2.1, "confidence": 0.95, "method": "bootstrap over requests",
                                  "n": 9}},
    "fixed": {"gpu_name": "cpu", "server_flags": {"max_num_seqs": "8"}},
    "retries": {"max_retries": 2, "num_retried_requests": 1, "num_retries": 2, "retry_wait_s": 0.5},
    "cache": {"mode": "isolated", "salt": "conveyor-c-2-0-0123456789ab", "prefix_cache_hit_rate": 0.7,
              "hit_rate_source": "usage", "expected_hit_rate": 0.74, "num_warm_pass_requests": 0, "warning": None},
}


def test_a_summary_with_every_section_round_trips_exactly() -> None:
    summary = summary_from_json(FULL, "x", "full")
    assert summary_to_json(summary) == FULL
    assert summary.request_rate == math.inf and not summary.valid and summary.retries is not None
    assert summary.server.queue_time_buckets == ((0.1, 5.0), (math.inf, 9.0))
    assert summary.per_class["chat"].ci["p95_ttft_ms"].high == math.inf
    assert summary.per_turn["1"].mean_prompt_tokens == 10.5


def test_typed_reads_match_the_file() -> None:
    path = next(p for p in SUMMARIES if "server" in json.loads(p.read_text()))
    data = json.loads(path.read_text())
    run = load_run(path.parent)
    assert run.summary.completed == data["completed"]
    assert run.metric("p95_ttft_ms") == data.get("p95_ttft_ms")
    assert run.server.value("queue_time_p95_ms") == data["server"].get("queue_time_p95_ms")
    rate = data.get("request_rate")
    assert run.offered_rate == (math.inf if rate in (None, "inf") else rate)


def test_unknown_keys_survive_and_a_missing_label_takes_the_directory_name() -> None:
    summary = summary_from_json({"future_key": {"a": [1, 2]}, "completed": 3}, "rate-1-rep0", "x/summary.json")
    assert summary.label == "rate-1-rep0" and summary.completed == 3
    assert summary_to_json(summary)["future_key"] == {"a": [1, 2]}


@pytest.mark.parametrize(("data", "where"), [({"completed": "many"}, "completed"),
                                             ({"server": {"available": "yes"}}, "server.available"),
                                             ({"per_class": {"chat": {"p95_ttft_ms": [1]}}}, "per_class.chat.p95_ttft_ms"),
                                             ({"ci": {"p95_ttft_ms": {"estimate": 1, "low": 0, "method": "?"}}},
                                              "ci.p95_ttft_ms.method")])
def test_a_wrong_type_names_the_file_and_the_key(tmp_path: pathlib.Path, data: dict[str, JSON], where: str) -> None:
    (tmp_path / "summary.json").write_text(json.dumps(data))
    with pytest.raises(RunDirError, match=f"summary.json.*{where}"):
        load_run(tmp_path)
