"""GuideLLM profiles and vLLM's flag combinations resolve to one load shape; contradictions are errors;
the steady-state window leaves warm-up and cool-down out of the summary but not out of requests.jsonl."""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any

import pytest
from bench_fake_server import FakeConfig, FakeServer

from conveyor.bench.load.client import RequestRecord
from conveyor.bench.load.profiles import LoadFlags, LoadProfile, LoadProfileError, resolve_load
from conveyor.bench.measure.runner import BenchError, BenchRunConfig, run_benchmark
from conveyor.bench.measure.summary import summary_to_json
from conveyor.bench.measure.window import WindowConfig, apply_window
from conveyor.bench.trace.arrivals import ArrivalProcess
from conveyor.bench.trace.traces import TraceRequest, make_trace, write_trace
from conveyor.cli import main


def run_to_json(cfg: BenchRunConfig) -> dict[str, Any]:
    """One run; its summary as summary.json holds it (these tests assert on the file's keys)."""
    return summary_to_json(run_benchmark(cfg))


def _flags(profile: str | None = None, rate: float = math.inf, arrival: str | None = None,
           cap: int | None = None) -> LoadFlags:
    return LoadFlags(profile=None if profile is None else LoadProfile(profile), request_rate=rate,
                     arrival=None if arrival is None else ArrivalProcess(arrival), max_concurrency=cap)


@pytest.mark.parametrize(("flags", "process", "rate", "cap"), [
    (_flags("synchronous"), ArrivalProcess.CONSTANT, math.inf, 1),
    (_flags("concurrent", cap=8), ArrivalProcess.CONSTANT, math.inf, 8),
    (_flags("throughput"), ArrivalProcess.CONSTANT, math.inf, None),
    (_flags("throughput", cap=16), ArrivalProcess.CONSTANT, math.inf, 16),
    (_flags("constant", rate=4.0), ArrivalProcess.CONSTANT, 4.0, None),
    (_flags("poisson", rate=4.0, cap=2), ArrivalProcess.POISSON, 4.0, 2),
    (_flags(rate=4.0, cap=3), ArrivalProcess.POISSON, 4.0, 3),  # vLLM: --request-rate with --max-concurrency
    (_flags(arrival="gamma", rate=2.0), ArrivalProcess.GAMMA, 2.0, None),
])
def test_profiles_resolve(flags: LoadFlags, process: ArrivalProcess, rate: float, cap: int | None) -> None:
    shape = resolve_load(flags)
    assert (shape.arrival.process, shape.arrival.request_rate, shape.max_concurrency) == (process, rate, cap)


@pytest.mark.parametrize(("flags", "message"), [
    (_flags("concurrent"), "needs --max-concurrency"),
    (_flags("synchronous", cap=4), "drop --max-concurrency"),
    (_flags("synchronous", rate=2.0), "drop --rate"),
    (_flags("poisson"), "needs a finite --rate"),
    (_flags("poisson", rate=1.0, arrival="gamma"), "drop --arrival gamma"),
    (_flags("throughput", arrival="replay"), "drop --arrival"),
    (_flags(cap=0), "--max-concurrency must be >= 1"),
])
def test_contradictions_name_the_flag(flags: LoadFlags, message: str) -> None:
    with pytest.raises(LoadProfileError, match=message):
        resolve_load(flags)


def test_cli_rejects_a_profile_without_its_flag(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "run", "--base-url", "http://127.0.0.1:9", "--trace", "t", "--out", "o", "--profile", "concurrent"]
    assert main(argv) == 2
    assert "--max-concurrency" in capsys.readouterr().err


def _rec(i: int, sent_s: float) -> RequestRecord:
    return RequestRecord(request_id=str(i), request_class="c", scheduled_s=sent_s, sent_s=sent_s, end_s=sent_s + 1)


def test_window_by_count_and_by_time() -> None:
    records = [_rec(i, float(i)) for i in range(10)]  # sent at 0..9 s
    window = apply_window(records, WindowConfig(warmup_requests=2, cooldown_s=2.5))
    assert [r.in_window for r in records] == [False] * 2 + [True] * 5 + [False] * 3  # last sent 9 s: > 6.5 out
    assert (window["num_warmup"], window["num_cooldown"], window["num_measured"]) == (2, 3, 5)
    assert (window["start_s"], window["end_s"]) == (2.0, 6.0) and "5 of 10" in window["label"]
    window = apply_window(records, WindowConfig(warmup_s=3.0, cooldown_requests=1))
    assert window["num_measured"] == 6 and not records[2].in_window and not records[9].in_window
    assert "whole run" in apply_window(records, WindowConfig())["label"]


def test_run_summarizes_only_the_window_and_records_everything(tmp_path: pathlib.Path) -> None:
    requests = [TraceRequest(request_id=f"r{i}", request_class="chat", prompt="ok go", prompt_len=2, output_len=3)
                for i in range(8)]
    path = tmp_path / "t.jsonl"
    write_trace(make_trace(requests, 0, {"name": "test"}), path)
    with FakeServer(FakeConfig(token_delay_s=0.003)) as server:
        summary = run_to_json(BenchRunConfig(
            base_url=server.base_url, trace_path=str(path), out_dir=str(tmp_path / "run"), profile="concurrent",
            max_concurrency=2, warmup_requests=3, cooldown_requests=1, show_progress=False,
            max_send_lag_p99_ms=1000.0, scrape_interval_s=0.2))
    assert summary["num_sent"] == 8 and summary["num_prompts"] == summary["completed"] == 4
    assert summary["window"]["num_warmup"] == 3 and summary["window"]["num_cooldown"] == 1
    assert summary["profile"] == "concurrent" and summary["max_concurrency"] == 2
    lines = [json.loads(x) for x in (tmp_path / "run" / "requests.jsonl").read_text().splitlines()]
    assert len(lines) == 8 and sum(x["in_window"] for x in lines) == 4


def test_a_window_that_leaves_nothing_is_refused(tmp_path: pathlib.Path) -> None:
    requests = [TraceRequest(request_id=f"r{i}", request_class="chat", prompt="ok", prompt_len=1, output_len=1)
                for i in range(3)]
    path = tmp_path / "t.jsonl"
    write_trace(make_trace(requests, 0, {"name": "test"}), path)
    with pytest.raises(BenchError, match="--warmup-requests"):
        run_to_json(BenchRunConfig(base_url="http://127.0.0.1:9", trace_path=str(path), out_dir=str(tmp_path),
                                     warmup_requests=2, cooldown_requests=1))
