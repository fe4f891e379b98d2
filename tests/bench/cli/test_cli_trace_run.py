"""`conveyor trace make|import|show` and `conveyor bench run` through the real CLI dispatcher."""

from __future__ import annotations

import json
import pathlib

import pytest
from bench_fake_server import FakeConfig, FakeServer

from conveyor.cli import main


def test_trace_make_show_import(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t.jsonl"
    assert main(["trace", "make", "--mix", "chat=0.5,agent=0.5", "--num-requests", "20", "--rate", "4",
                 "--param", "agent.documents_len=50", "--seed", "2", "--out", str(out)]) == 0
    header = json.loads(out.read_text().splitlines()[0])
    assert header["num_requests"] == 20 and header["generator"]["config"]["agent"]["documents_len"] == 50
    assert main(["trace", "show", str(out)]) == 0
    assert "arrivals:" in capsys.readouterr().out
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps({"timestamp": 1, "prompt": "private words", "output_tokens": 3}) + "\n")
    assert main(["trace", "import", str(log), "--anonymize", "--out", str(tmp_path / "a.jsonl")]) == 0
    assert "private" not in (tmp_path / "a.jsonl").read_text()


@pytest.mark.parametrize(("argv", "message"), [
    (["trace", "make", "--mix", "chat=0.5,video=0.5", "--out", "x"], "--mix"),
    (["trace", "make", "--mix", "chat=abc", "--out", "x"], "--mix"),
    (["trace", "make", "--duration", "5", "--out", "x"], "--duration needs --rate"),
    (["trace", "make", "--param", "long.nope=1", "--out", "x"], "--param"),
    (["trace", "show", "/nonexistent/trace.jsonl"], "does not exist"),
    (["bench", "run", "--base-url", "localhost:8000", "--trace", "t", "--out", "o"], "--base-url"),
    (["bench", "run", "--base-url", "http://127.0.0.1:9", "--trace", "/nonexistent", "--out", "o"], "does not exist"),
    (["bench", "run", "--base-url", "http://127.0.0.1:9", "--trace", "t", "--out", "o", "--goodput", "ttft=1"],
     "--goodput"),
])
def test_clear_errors_name_the_flag(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_bench_run_prints_the_dashboard_row(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    assert main(["trace", "make", "--mix", "chat=1", "--num-requests", "6", "--param", "chat.output_len_max=8",
                 "--param", "chat.prompt_len_max=16", "--out", str(trace)]) == 0
    with FakeServer() as server:
        rc = main(["bench", "run", "--base-url", server.base_url, "--trace", str(trace), "--rate", "50",
                   "--out", str(tmp_path / "run"), "--label", "fake@50", "--no-progress", "--goodput", "ttft:5000",
                   "--max-send-lag-ms", "1000"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "Offered req/s" in out and "Preemptions" in out and "Peak memory" in out and "fake@50" in out
    assert (tmp_path / "run" / "command.txt").read_text().startswith("conveyor ")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["completed"] == 6 and summary["goodput"] is not None


def test_exact_lengths_from_the_servers_tokenize(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "t.jsonl"
    with FakeServer() as server:  # its /tokenize counts words + 1 (a BOS token)
        assert main(["trace", "make", "--mix", "chat=1", "--num-requests", "5", "--tokenize-url", server.base_url,
                     "--out", str(out)]) == 0
    from conveyor.bench.trace.traces import read_trace
    trace = read_trace(out)  # still verifies: the version covers the measured lengths
    assert all(r.prompt_len == len(str(r.prompt).split()) + 1 for r in trace.requests)
    assert main(["trace", "make", "--num-requests", "2", "--tokenize-url", "http://127.0.0.1:9",
                 "--out", str(tmp_path / "x.jsonl")]) == 2


def test_bench_sweep_over_concurrency(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    # 40 requests: the fewest that bound a p95 from above (bench/measure/intervals.py); 6 would stay undecided
    assert main(["trace", "make", "--mix", "chat=1", "--num-requests", "40", "--param", "chat.output_len_max=6",
                 "--param", "chat.prompt_len_max=16", "--out", str(trace)]) == 0
    with FakeServer() as server:
        rc = main(["bench", "sweep", "--base-url", server.base_url, "--trace", str(trace), "--over", "concurrency",
                   "--max-concurrency", "2", "--slo", "ttft_p95_ms=60000", "--repeats", "1", "--out",
                   str(tmp_path / "sw"), "--max-send-lag-ms", "1000"])
    assert rc == 0 and "Highest concurrency meeting the objective: 2.0" in capsys.readouterr().out
    summary = json.loads((tmp_path / "sw" / "concurrency-2-rep0" / "summary.json").read_text())
    assert summary["max_concurrency"] == 2 and summary["request_rate"] == "inf" and summary["completed"] == 40
    assert summary["client"]["peak_in_flight"] <= 2


def test_bench_run_collects_the_step_log_only_when_the_server_offers_one(tmp_path: pathlib.Path) -> None:
    trace = tmp_path / "t.jsonl"
    assert main(["trace", "make", "--mix", "chat=1", "--num-requests", "6", "--param", "chat.output_len_max=8",
                 "--param", "chat.prompt_len_max=16", "--out", str(trace)]) == 0
    common = ["bench", "run", "--trace", str(trace), "--rate", "50", "--no-progress", "--max-send-lag-ms", "1000",
              "--collect-step-log"]
    with FakeServer(FakeConfig(step_log=True)) as server:
        server.state.steps.append({"num_prefill_tokens": 999})  # logged before the run: dropped
        assert main([*common, "--base-url", server.base_url, "--out", str(tmp_path / "run")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "step_log.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and all(row["num_prefill_reqs"] == 1 for row in rows)
    assert server.state.num_step_log_drains >= 2  # before the run, and after it
    with FakeServer() as server:  # no /step_log (vLLM, or --step-log-size 0): the run goes on without the file
        assert main([*common, "--base-url", server.base_url, "--out", str(tmp_path / "plain")]) == 0
    assert not (tmp_path / "plain" / "step_log.jsonl").exists()
