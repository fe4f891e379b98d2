"""Metric definitions on hand-made records, and the Prometheus text parser / histogram_quantile."""

from __future__ import annotations

import math

import pytest

from conveyor.bench.load.client import ErrorKind, RequestRecord, RequestStatus
from conveyor.bench.measure.metrics import GoodputBounds, client_summary, parse_goodput, send_lag_p99_ms, validity
from conveyor.bench.measure.prom_text import Snapshot, bucket_delta, histogram_quantile
from conveyor.bench.measure.server_metrics import ServerObservation, config_info, server_summary


def _done(rid: str, sent: float, ttft: float, itl: list[float], tokens: int, klass: str = "chat") -> RequestRecord:
    e2e = ttft + sum(itl)
    return RequestRecord(request_id=rid, request_class=klass, scheduled_s=sent, sent_s=sent,
                         status=RequestStatus.COMPLETED, prompt_tokens=10, output_tokens=tokens, ttft_s=ttft,
                         itl_s=itl, e2e_s=e2e, tpot_s=(e2e - ttft) / (tokens - 1), end_s=sent + e2e)


RECORDS = [
    _done("a", 0.0, 0.100, [0.02, 0.02, 0.02], 4),
    _done("b", 1.0, 0.300, [0.05, 0.05], 3, klass="long"),
    RequestRecord(request_id="c", request_class="chat", scheduled_s=1.5, sent_s=1.5, status=RequestStatus.FAILED,
                  error_kind=ErrorKind.HTTP_503, http_status=503, end_s=1.6),
    RequestRecord(request_id="d", request_class="agent", scheduled_s=2.0, sent_s=2.0,
                  status=RequestStatus.CANCELLED, ttft_s=0.2, output_tokens=2, end_s=4.0),
]


def test_summary_on_hand_made_records() -> None:
    s = client_summary(RECORDS, parse_goodput("ttft:200,tpot:30"))
    assert (s["num_prompts"], s["completed"], s["failed"], s["cancelled"]) == (4, 2, 1, 1)
    assert s["duration"] == pytest.approx(4.0)  # first dispatch 0.0 -> last end 4.0
    assert s["request_throughput"] == pytest.approx(0.5)
    assert s["total_output_tokens"] == 7 and s["output_throughput"] == pytest.approx(7 / 4)
    assert s["total_token_throughput"] == pytest.approx(27 / 4)
    assert s["mean_ttft_ms"] == pytest.approx(200.0) and s["median_ttft_ms"] == pytest.approx(200.0)
    assert s["std_ttft_ms"] == pytest.approx(100.0)  # population std, as numpy/vLLM
    assert s["p99_ttft_ms"] == pytest.approx(100 + 0.99 * 200)  # linear interpolation
    assert s["mean_itl_ms"] == pytest.approx(1000 * (0.06 + 0.10) / 5)  # pooled gaps
    assert s["mean_tpot_ms"] == pytest.approx(1000 * (0.02 + 0.05) / 2)
    assert s["p50_e2el_ms"] == pytest.approx(1000 * (0.16 + 0.40) / 2)
    assert s["goodput"] == pytest.approx(1 / 4)  # only "a" meets ttft<=200 and tpot<=30
    assert s["error_rate"] == pytest.approx(1 / 3)  # failed / (sent - cancelled)
    assert s["errors_by_kind"] == {"http_503": 1}
    assert s["per_class"]["long"]["p95_ttft_ms"] == pytest.approx(300.0)
    assert s["per_class"]["agent"]["cancelled"] == 1 and s["per_class"]["agent"]["p50_ttft_ms"] is None
    assert s["per_class"]["chat"]["error_rate"] == pytest.approx(0.5)


def test_empty_and_no_slo() -> None:
    s = client_summary([], None)
    assert s["duration"] == 0.0 and s["p95_ttft_ms"] is None and s["goodput"] is None and s["slo"] == {}
    assert s["error_rate"] == 0.0


def test_goodput_parsing_and_send_lag_validity() -> None:
    assert parse_goodput("ttft:200, e2el:3000") == GoodputBounds(ttft_ms=200.0, e2el_ms=3000.0)
    for bad in ("ttft=200", "foo:1", "ttft:abc", "tpot:-1"):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)
    lagged = [RequestRecord(request_id=str(i), request_class="c", scheduled_s=0.0, send_lag_s=0.001 * i)
              for i in range(101)]
    assert send_lag_p99_ms(lagged) == pytest.approx(99.0)
    assert validity(5.0, 10.0) == (True, None)
    ok, reason = validity(99.0, 10.0)
    assert not ok and reason is not None and "send lag" in reason


PROM_BEFORE = """# HELP vllm:request_queue_time_seconds Histogram of time spent in WAITING phase.
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_bucket{le="0.1",model_name="m"} 10.0
vllm:request_queue_time_seconds_bucket{le="0.5",model_name="m"} 10.0
vllm:request_queue_time_seconds_bucket{le="+Inf",model_name="m"} 10.0
vllm:num_preemptions_total{model_name="m"} 3.0
vllm:prefix_cache_queries_total{model_name="m"} 100.0
vllm:prefix_cache_hits_total{model_name="m"} 50.0
vllm:cache_config_info{block_size="16",enable_prefix_caching="True",model_name="m",weird="a\\"b,c"} 1.0
"""
PROM_AFTER = PROM_BEFORE.replace('le="0.1",model_name="m"} 10.0', 'le="0.1",model_name="m"} 30.0').replace(
    'le="0.5",model_name="m"} 10.0', 'le="0.5",model_name="m"} 40.0').replace(
    'le="+Inf",model_name="m"} 10.0', 'le="+Inf",model_name="m"} 50.0').replace(
    "num_preemptions_total{model_name=\"m\"} 3.0", "num_preemptions_total{model_name=\"m\"} 8.0").replace(
    "queries_total{model_name=\"m\"} 100.0", "queries_total{model_name=\"m\"} 300.0").replace(
    "hits_total{model_name=\"m\"} 50.0", "hits_total{model_name=\"m\"} 100.0")


def test_prometheus_parsing_and_quantiles() -> None:
    before, after = Snapshot.from_text(PROM_BEFORE), Snapshot.from_text(PROM_AFTER)
    assert config_info(after) == {"block_size": "16", "enable_prefix_caching": "True", "model_name": "m",
                                  "weird": 'a"b,c'}
    delta = bucket_delta(after.buckets("vllm:request_queue_time_seconds"),
                         before.buckets("vllm:request_queue_time_seconds"))
    assert delta == [(0.1, 20.0), (0.5, 30.0), (math.inf, 40.0)]
    assert histogram_quantile(0.5, delta) == pytest.approx(0.1 * 20 / 20)  # rank 20 ends the first bucket
    assert histogram_quantile(0.625, delta) == pytest.approx(0.1 + 0.4 * 5 / 10)
    assert histogram_quantile(0.99, delta) == pytest.approx(0.5)  # +Inf bucket -> highest finite bound
    assert histogram_quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]) is None
    s = server_summary(ServerObservation(before=before, after=after))
    assert s["available"] and s["num_preemptions"] == 5.0 and s["prefix_cache_hit_rate"] == pytest.approx(0.25)
    # p50 falls in the lowest bucket: "<= 100 ms", never an interpolated 100 ms (or 95 ms).
    assert s["queue_time_p50_ms"] is None and s["queue_time_p50_bucket_ms"] == [0.0, 100.0]
    # rank 20 of 40 sits on the bucket edge: resampled requests land in the next bucket half the time.
    assert s["ci"]["queue_time_p50_ms"]["high"] == pytest.approx(500.0) and s["generation_tokens"] is None
    assert s["queue_time_p95_ms"] is None and s["queue_time_p95_bucket_ms"] == [500.0, "inf"]
