"""`conveyor simulate --trace`: a trace replayed through the real scheduler, written as a run directory that
`conveyor report` reads like a measured one and marks simulated."""

from __future__ import annotations

import itertools
import json
import pathlib

import pytest

from conveyor import cli
from conveyor.bench.measure.rundirs import load_run
from conveyor.bench.report.dashboard import (
    ReportInputs,
    analyze,
    dashboard_rows,
    decision_lines,
)
from conveyor.bench.trace.traces import TraceRequest, make_trace, write_trace
from conveyor.sim.workload import LoadSettings, prompt_tokens, sim_requests


def small_trace(path: pathlib.Path) -> pathlib.Path:
    requests = [TraceRequest(f"c{i}", "chat", 40, 8, prompt="hi " * 40, prefix_group="sys", shared_prefix_len=32)
                for i in range(12)]
    requests.append(TraceRequest("x", "long", 300, 16, prompt="x " * 300, cancel_after_tokens=4))
    requests += [TraceRequest(f"s-{k}", "agent", 20, 6, prompt="t " * 20, session_id="s", turn=k,
                              think_time_s=0.2 if k else None) for k in range(3)]
    write_trace(make_trace(requests, seed=0, generator={"name": "test"}), path)
    return path


def test_a_group_shares_its_prefix_tokens_and_nothing_else() -> None:
    a, b = (TraceRequest(n, "chat", 40, 8, prompt="p", prefix_group="g", shared_prefix_len=32) for n in "ab")
    ta, tb = prompt_tokens(a), prompt_tokens(b)
    assert len(ta) == 40 and ta[:32] == tb[:32] and ta[32:] != tb[32:]
    assert prompt_tokens(TraceRequest("c", "chat", 3, 1, prompt_token_ids=[5, 6, 7])) == (5, 6, 7)


def test_due_times_are_bench_runs(tmp_path: pathlib.Path) -> None:
    from conveyor.bench.trace.traces import read_trace
    trace = read_trace(small_trace(tmp_path / "t.jsonl"))
    requests = sim_requests(trace, LoadSettings(request_rate=4.0, arrival="constant"))
    due = [r.due_s for r in requests]
    assert due[:3] == [0.0, 0.25, 0.5]  # constant arrivals: one unit every 1/rate
    assert [r.due_s is None for r in requests if r.session_id] == [False, True, True]  # later turns follow answers


def test_simulated_run_dir_reads_like_a_measured_one(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace, out = small_trace(tmp_path / "t.jsonl"), tmp_path / "sim-run"
    assert cli.main(["simulate", "--trace", str(trace), "--rate", "5", "--out-dir", str(out),
                     "--max-num-seqs", "4", "--step-time-base-s", "0.01"]) == 0
    assert "simulated 16 requests" in capsys.readouterr().out
    for name in ("summary.json", "requests.jsonl", "server_timeseries.jsonl", "command.txt", "config.json"):
        assert (out / name).is_file(), name
    run = load_run(out)
    s = run.summary
    assert s.simulated is not None and "10 ms" in s.simulated.step_time
    assert (s.completed, s.cancelled, s.num_prompts) == (15, 1, 16)
    assert s.request_rate == 5.0 and s.fixed["server_flags"]["max_num_seqs"] == "4"  # type: ignore[index]
    assert s.cache.prefix_cache_hit_rate and s.cache.prefix_cache_hit_rate > 0.2  # the shared system prompt hits
    assert s.num_sessions == 1 and set(s.per_turn) == {"0", "1", "2"}
    analysis = analyze(ReportInputs((out,)))
    assert any(row[1] == "sim-run (simulated)" for row in dashboard_rows(analysis))
    assert any(line.startswith("Simulated, not measured: sim-run") for line in decision_lines(analysis))
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert {r["status"] for r in rows} == {"completed", "cancelled"}


def test_trace_flags_fail_in_one_line(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = small_trace(tmp_path / "t.jsonl")
    assert cli.main(["simulate", "--trace", str(trace)]) == 2
    assert "--out-dir" in capsys.readouterr().err
    assert cli.main(["simulate", "--trace", str(trace), "--out-dir", str(tmp_path / "o"), "--rate", "0"]) == 2
    err = capsys.readouterr().err
    assert "--rate" in err and len(err.strip().splitlines()) == 1


def test_poisson_workload_flags_are_refused_with_a_trace(tmp_path: pathlib.Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    trace = small_trace(tmp_path / "t.jsonl")
    assert cli.main(["simulate", "--trace", str(trace), "--out-dir", str(tmp_path / "o"), "--request-rate", "3"]) == 2
    assert "--request-rate shapes the Poisson workload" in capsys.readouterr().err


def test_a_closed_loop_profile_sends_one_request_at_a_time(tmp_path: pathlib.Path) -> None:
    trace, out = small_trace(tmp_path / "t.jsonl"), tmp_path / "sync"
    assert cli.main(["simulate", "--trace", str(trace), "--profile", "synchronous", "--out-dir", str(out)]) == 0
    summary = load_run(out).summary
    assert summary.identity.max_concurrency == 1 and summary.completed + summary.cancelled == 16
    rows = sorted((json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()),
                  key=lambda r: r["sent_s"])
    assert all(later["sent_s"] >= earlier["end_s"] - 1e-9 for earlier, later in itertools.pairwise(rows))
    assert max(r["client_queue_s"] for r in rows) > 0  # all due at once, each waited for its slot
