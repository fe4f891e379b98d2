"""The client against a fake server: errors by kind, stalls, broken streams, error objects, cancellations."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
from bench_fake_server import FakeConfig, FakeServer

from conveyor.bench.measure.runner import BenchRunConfig, run_benchmark
from conveyor.bench.measure.summary import summary_to_json
from conveyor.bench.trace.traces import TraceRequest, make_trace, write_trace


def run_to_json(cfg: BenchRunConfig) -> dict[str, Any]:
    """One run; its summary as summary.json holds it (these tests assert on the file's keys)."""
    return summary_to_json(run_benchmark(cfg))

MODES = ["ok", "ok", "ok", "http400", "http500", "http503", "stall", "break", "errobj", "nodone"]


def _trace(tmp_path: pathlib.Path, requests: list[TraceRequest]) -> str:
    path = tmp_path / "trace.jsonl"
    write_trace(make_trace(requests, 0, {"name": "test"}), path)
    return str(path)


def _req(i: int, mode: str, output_len: int = 6, **kw: object) -> TraceRequest:
    return TraceRequest(request_id=f"q{i}", request_class=kw.pop("klass", "chat"),  # type: ignore[arg-type]
                        prompt=f"{mode} some words here", prompt_len=4, output_len=output_len, **kw)  # type: ignore[arg-type]


def _run(tmp_path: pathlib.Path, server: FakeServer, requests: list[TraceRequest], **kw: object) -> tuple[dict, dict]:
    cfg = BenchRunConfig(base_url=server.base_url, trace_path=_trace(tmp_path, requests), request_rate=200.0,
                         out_dir=str(tmp_path / "run"), request_timeout_s=0.6, show_progress=False,
                         scrape_interval_s=0.1, max_send_lag_p99_ms=1000.0, **kw)  # type: ignore[arg-type]
    # (a generous lag bound: this machine is shared; the validity rule itself is tested on hand-made records)
    summary = run_to_json(cfg)
    records = {}
    for line in (tmp_path / "run" / "requests.jsonl").read_text().splitlines():
        rec = json.loads(line)
        records[rec["request_id"]] = rec
    return summary, records


def test_every_outcome_is_classified_and_accounted_for(tmp_path: pathlib.Path) -> None:
    requests = [_req(i, m) for i, m in enumerate(MODES)]
    requests.append(_req(100, "ok", output_len=40, cancel_after_tokens=3, klass="agent"))
    requests.append(_req(101, "ok", output_len=400, cancel_after_s=0.1, klass="agent"))
    with FakeServer(FakeConfig(token_delay_s=0.003)) as server:
        summary, rec = _run(tmp_path, server, requests)
        assert server.state.num_disconnects >= 2  # the cancelled streams were really closed
    expect = {"q3": ("failed", "http_4xx"), "q4": ("failed", "http_5xx"), "q5": ("failed", "http_503"),
              "q6": ("failed", "timeout"), "q7": ("failed", "stream_error"), "q8": ("failed", "http_503"),
              "q9": ("failed", "stream_error"), "q100": ("cancelled", None), "q101": ("cancelled", None)}
    for rid, (status, kind) in expect.items():
        assert (rec[rid]["status"], rec[rid]["error_kind"]) == (status, kind), rid
    assert rec["q8"]["http_status"] == 200  # HTTP 200 carrying an error object is a failure, never a success
    assert rec["q100"]["output_tokens"] == 3
    assert summary["completed"] + summary["cancelled"] + summary["failed"] == summary["num_prompts"] == 12
    assert (summary["completed"], summary["cancelled"], summary["failed"]) == (3, 2, 7)
    assert summary["error_rate"] == pytest.approx(7 / 10)
    assert summary["errors_by_kind"] == {"http_4xx": 1, "http_5xx": 1, "http_503": 2, "timeout": 1, "stream_error": 2}
    assert summary["per_class"]["agent"]["cancelled"] == 2 and summary["per_class"]["chat"]["completed"] == 3


def test_completed_records_follow_vllm_definitions(tmp_path: pathlib.Path) -> None:
    with FakeServer(FakeConfig(token_delay_s=0.01)) as server:
        summary, rec = _run(tmp_path, server, [_req(i, "ok", output_len=5) for i in range(4)])
        generated = server.state.generation_tokens
    for r in rec.values():
        assert r["status"] == "completed" and r["output_tokens"] == 5 and len(r["itl_s"]) == 4
        assert r["ttft_s"] >= 0.009 and r["e2e_s"] == pytest.approx(r["ttft_s"] + sum(r["itl_s"]), abs=1e-6)
        assert r["tpot_s"] == pytest.approx((r["e2e_s"] - r["ttft_s"]) / 4)
        assert r["sent_s"] >= r["scheduled_s"] and r["send_lag_s"] == pytest.approx(r["sent_s"] - r["scheduled_s"])
    assert summary["total_output_tokens"] == generated == summary["server"]["generation_tokens"]
    assert summary["server"]["available"] and summary["server"]["queue_time_p95_ms"] is not None
    assert summary["valid"] and summary["send_lag_p99_ms"] < summary["max_send_lag_p99_ms"]


def test_chat_endpoint_without_usage_counts_text_chunks(tmp_path: pathlib.Path) -> None:
    with FakeServer(FakeConfig(send_usage=False)) as server:
        summary, rec = _run(tmp_path, server, [_req(i, "ok", output_len=7) for i in range(3)], endpoint="chat")
    for r in rec.values():
        # the role-only first chunk starts TTFT (as in vLLM) but is not a token: 7 tokens, 7 gaps
        assert r["status"] == "completed" and r["output_tokens"] == 7 and len(r["itl_s"]) == 7
        assert r["prompt_tokens"] == 4  # no usage: the trace's prompt_len
    assert summary["total_output_tokens"] == 21


def test_server_without_metrics_is_still_a_valid_run(tmp_path: pathlib.Path) -> None:
    with FakeServer(FakeConfig(with_metrics=False)) as server:
        summary, _ = _run(tmp_path, server, [_req(i, "ok") for i in range(3)])
    assert summary["valid"] and summary["completed"] == 3
    assert summary["server"]["available"] is False and summary["server"]["queue_time_p95_ms"] is None
    assert (tmp_path / "run" / "server_timeseries.jsonl").read_text() == ""


def test_run_directory_contract(tmp_path: pathlib.Path) -> None:
    with FakeServer() as server:
        summary, _ = _run(tmp_path, server, [_req(i, "ok") for i in range(3)], label="smoke",
                          slo=_Slo(ttft_ms=10_000.0, e2el_ms=10_000.0))
    run = tmp_path / "run"
    for name in ("command.txt", "config.json", "server.json", "requests.jsonl", "server_timeseries.jsonl"):
        assert (run / name).is_file(), name
    identity = json.loads((run / "server.json").read_text())
    assert identity["models"]["data"][0]["id"] == "fake-model" and identity["config_info"]["block_size"] == "16"
    assert json.loads((run / "summary.json").read_text()) == summary
    assert summary["label"] == "smoke" and summary["model"] == "fake-model" and summary["schema_version"] == 1
    assert summary["goodput"] == pytest.approx(summary["request_throughput"])
    assert summary["slo"] == {"ttft_ms": 10_000.0, "tpot_ms": None, "itl_ms": None, "e2el_ms": 10_000.0}
    ts = [json.loads(line) for line in (run / "server_timeseries.jsonl").read_text().splitlines()]
    assert ts and set(ts[0]) == {"t_s", "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"}


class _Slo:
    """Stands for bench/decide/slo.py's SLO: the runner reads its per-request bounds by name."""

    def __init__(self, ttft_ms: float, e2el_ms: float) -> None:
        self.ttft_ms, self.e2el_ms, self.tpot_ms = ttft_ms, e2el_ms, None


def test_the_stdlib_json_fallback_gives_the_same_bytes_and_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from conveyor.bench.load import client

    monkeypatch.setitem(sys.modules, "orjson", None)  # as if orjson were not installed
    loads, dumps, name = client._json_codec()
    assert name == "json"
    event = b'{"choices":[{"index":0,"text":" x"}],"usage":null}'
    assert loads(event) == client.json_loads(event)
    assert loads(dumps({"prompt": "é", "max_tokens": 3})) == {"prompt": "é", "max_tokens": 3}


def test_temperature_is_sent_only_when_given() -> None:
    from conveyor.bench.load.client import ClientConfig, Endpoint, build_payload
    from conveyor.bench.measure.runner import BenchError

    request = _req(0, "ok")
    plain = ClientConfig(base_url="http://127.0.0.1:1", model="m", endpoint=Endpoint.CHAT)
    assert "temperature" not in build_payload(plain, request)
    greedy = ClientConfig(base_url="http://127.0.0.1:1", model="m", temperature=0.0)
    assert build_payload(greedy, request)["temperature"] == 0.0
    with pytest.raises(BenchError, match="--temperature"):
        BenchRunConfig(base_url="http://127.0.0.1:1", trace_path="t", request_rate=1.0, out_dir="o", temperature=-1.0)


def test_duration_sends_rate_times_seconds_and_num_requests_wins() -> None:
    from conveyor.bench.measure.runner import BenchError

    def cfg(**kw: object) -> BenchRunConfig:
        return BenchRunConfig(base_url="http://127.0.0.1:1", trace_path="t", out_dir="o", **kw)  # type: ignore[arg-type]

    assert cfg(request_rate=2.0, duration_s=30.0).num_to_send() == 60
    assert cfg(request_rate=0.75, duration_s=10.0).num_to_send() == 8  # whole requests, rounded up
    assert cfg(request_rate=2.0, duration_s=30.0, num_requests=10).num_to_send() == 10
    assert cfg(request_rate=2.0).num_to_send() is None
    with pytest.raises(BenchError, match="--duration"):
        cfg(duration_s=30.0)  # an infinite rate has no seconds of arrivals
    with pytest.raises(BenchError, match="--duration"):
        cfg(request_rate=1.0, duration_s=0.0)


def test_a_run_with_a_duration_sends_that_many_requests(tmp_path: pathlib.Path) -> None:
    requests = [_req(i, "ok") for i in range(30)]
    with FakeServer(FakeConfig()) as server:
        summary, records = _run(tmp_path, server, requests, duration_s=0.05)  # 200 req/s x 0.05 s
    assert len(records) == 10 and summary["num_prompts"] == 10
