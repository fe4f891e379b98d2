"""--workers: one schedule split across processes, merged exactly, each worker's send lag judged."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import numpy as np
import pytest
from bench_fake_server import FakeConfig, FakeServer

from conveyor.bench.load.client import RequestRecord
from conveyor.bench.load.loadgen import LoadPlan
from conveyor.bench.load.workers import WorkerStats, split_plan
from conveyor.bench.measure.load_summary import LoadOutcome, load_validity, peak_in_flight
from conveyor.bench.measure.runner import BenchRunConfig, run_benchmark
from conveyor.bench.measure.summary import summary_to_json
from conveyor.bench.trace.traces import TraceRequest, make_trace, write_trace


def run_to_json(cfg: BenchRunConfig) -> dict[str, Any]:
    """One run; its summary as summary.json holds it (these tests assert on the file's keys)."""
    return summary_to_json(run_benchmark(cfg))


def _reqs(n: int) -> list[TraceRequest]:
    return [TraceRequest(request_id=f"r{i}", request_class="chat" if i % 2 else "long", prompt="ok go", prompt_len=2,
                         output_len=4) for i in range(n)]


def test_split_keeps_every_due_time_and_splits_the_cap() -> None:
    requests = _reqs(11)
    plan = LoadPlan(units=[[r] for r in requests], offsets_s=[0.1 * i for i in range(11)], max_concurrency=5)
    parts = split_plan(plan, 3)
    merged = sorted((o, u[0].request_id) for p in parts for u, o in zip(p.units, p.offsets_s))
    assert merged == sorted(zip(plan.offsets_s, [r.request_id for r in requests]))
    assert [p.max_concurrency for p in parts] == [2, 2, 1] and [p.worker for p in parts] == [0, 1, 2]
    with pytest.raises(ValueError, match="cannot be split"):
        split_plan(plan, 6)


def test_two_workers_merge_exactly_and_respect_the_cap(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "t.jsonl"
    write_trace(make_trace(_reqs(24), 0, {"name": "test"}), path)
    with FakeServer(FakeConfig(token_delay_s=0.004)) as server:
        summary = run_to_json(BenchRunConfig(
            base_url=server.base_url, trace_path=str(path), out_dir=str(tmp_path / "run"), request_rate=200.0,
            max_concurrency=4, num_workers=2, show_progress=False, max_send_lag_p99_ms=1000.0,
            scrape_interval_s=0.2))
        assert server.state.max_in_flight <= 4 and server.state.num_requests == 24
    lines = [json.loads(x) for x in (tmp_path / "run" / "requests.jsonl").read_text().splitlines()]
    assert [x["request_id"] for x in lines] == [f"r{i}" for i in range(24)]  # trace order, whoever sent it
    assert {x["worker"] for x in lines} == {0, 1}
    assert summary["completed"] == 24 and summary["client"]["num_workers"] == 2
    assert len(summary["client"]["send_lag_p99_ms_per_worker"]) == 2
    ttft_ms = [x["ttft_s"] * 1000 for x in lines]  # percentiles over all samples, not averaged per worker
    assert summary["p99_ttft_ms"] == pytest.approx(float(np.percentile(ttft_ms, 99)))
    itl_ms = [g * 1000 for x in lines for g in x["itl_s"]]
    assert summary["median_itl_ms"] == pytest.approx(float(np.median(itl_ms)))
    assert min(x["sent_s"] for x in lines) >= 0  # one time origin for both workers


def test_one_lagging_worker_invalidates_the_run() -> None:
    records = [RequestRecord(request_id=str(i), request_class="c", scheduled_s=0.0, send_lag_s=0.05 * (i % 2),
                             worker=i % 2) for i in range(10)]
    load = LoadOutcome(records=records, t0=0.0, workers=[WorkerStats(0, 5, 0.1), WorkerStats(1, 5, 0.1)])
    valid, reason = load_validity(load, {"num_measured": 10}, bound_ms=10.0)
    assert not valid and reason is not None and reason.startswith("worker 1:")


def test_peak_in_flight_from_records() -> None:
    spans = [(0.0, 1.0), (0.5, 2.0), (1.0, 1.5), (3.0, 4.0)]  # an end and a send at 1.0: ends count first
    records = [RequestRecord(request_id=str(i), request_class="c", scheduled_s=a, sent_s=a, end_s=b)
               for i, (a, b) in enumerate(spans)]
    assert peak_in_flight(records) == 2
