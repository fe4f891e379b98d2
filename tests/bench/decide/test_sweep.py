"""The rate search with a fake server whose capacity is known."""

from __future__ import annotations

import json
import pathlib

import pytest

from conveyor.bench.decide.slo import SLO
from conveyor.bench.decide.sweep import SweepConfig, SweepError, run_sweep
from conveyor.bench.measure.rundirs import discover_runs, group_points
from conveyor.bench.measure.summary import RunSummary, summary_from_json

SLO_E2E = SLO(e2e_p95_ms=1000, error_rate=0.05)


class FakeServer:
    """p95 E2E grows as offered load approaches capacity; beyond 2x capacity it runs away."""

    def __init__(self, capacity: float, noise: float = 0.0) -> None:
        self.capacity, self.noise, self.calls = capacity, noise, []

    def __call__(self, rate: float, repeat: int, run_dir: pathlib.Path, num_requests: int | None = None) -> RunSummary:
        self.calls.append((round(rate, 4), repeat))
        load = rate / self.capacity
        e2e = 500.0 / max(1e-3, 1.0 - load) if load < 1 else 50_000.0
        completed_rate = min(rate, self.capacity)
        backlog = 0.9 * rate * 10 if load >= 2 else 0.0
        summary = {"label": f"fake@{rate}#{repeat}", "request_rate": rate, "completed": int(completed_rate * 10),
                   "num_prompts": int(rate * 10), "duration": 10.0,
                   "request_throughput": completed_rate if load < 2 else 0.1 * rate,
                   "p95_e2el_ms": e2e * (1 + self.noise * repeat), "median_e2el_ms": e2e, "p95_ttft_ms": 100.0,
                   "error_rate": 0.0, "server": {"queue_time_p95_ms": 1.0, "num_requests_waiting_max": backlog}}
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_text(json.dumps(summary))
        return summary_from_json(summary, run_dir.name, "fake")


def test_geometric_then_bisection(tmp_path: pathlib.Path) -> None:
    server = FakeServer(capacity=6.0)  # e2e <= 1000 ms while rate <= 3.0
    cfg = SweepConfig(slo=SLO_E2E, start_rate=1.0, bisect_steps=2, num_repeats=2)
    result = run_sweep("fake", cfg, server, tmp_path, progress=lambda _: None)
    rates = [round(p.rate, 3) for p in result.points]
    # 1, 2 pass, 4 fails; bisect sqrt(2*4)=2.828 passes, sqrt(2.828*4)=3.364 fails.
    assert rates == [1.0, 2.0, 4.0, 2.828, 3.364]
    assert [p.passed for p in result.points] == [True, True, False, True, False]
    assert result.max_rate_meeting == pytest.approx(2.828, abs=1e-3)
    assert all(len(p.run_dirs) == 2 for p in result.points)
    saved = json.loads((tmp_path / "sweep.json").read_text())
    assert saved["max_rate_meeting"] == pytest.approx(2.828, abs=1e-3)
    assert saved["fixed"]["server_version"] == ["unknown"]
    # the run dirs are picked up as one configuration named after the sweep directory
    points = group_points(discover_runs([tmp_path]))
    assert list(points) == [tmp_path.name] and len(points[tmp_path.name]) == 5


def test_failing_start_searches_downward(tmp_path: pathlib.Path) -> None:
    server = FakeServer(capacity=1.0)  # passes at <= 0.5
    cfg = SweepConfig(slo=SLO_E2E, start_rate=1.0, bisect_steps=1, num_repeats=1)
    result = run_sweep("low", cfg, server, tmp_path, progress=lambda _: None)
    assert [round(p.rate, 3) for p in result.points] == [1.0, 0.5, 0.707]
    assert result.max_rate_meeting == 0.5


def test_runaway_stops_repeats_and_escalation(tmp_path: pathlib.Path) -> None:
    server = FakeServer(capacity=1.0)
    cfg = SweepConfig(slo=SLO(ttft_p95_ms=1000), start_rate=1.0, growth_factor=4.0, bisect_steps=0,
                      num_repeats=3)
    result = run_sweep("runaway", cfg, server, tmp_path, progress=lambda _: None)
    # 1 req/s passes (ttft only), at 4 req/s 36 of 40 requests wait at once: runaway after one repeat.
    assert server.calls == [(1.0, 0), (1.0, 1), (1.0, 2), (4.0, 0)]
    assert result.points[-1].runaway and "runaway" in result.points[-1].failures[0]


def test_spread_over_repeats_and_max_rate_cap(tmp_path: pathlib.Path) -> None:
    server = FakeServer(capacity=100.0, noise=0.1)
    cfg = SweepConfig(slo=SLO_E2E, start_rate=1.0, max_rate=3.0, num_repeats=3)
    result = run_sweep("cap", cfg, server, tmp_path, progress=lambda _: None)
    assert [p.rate for p in result.points] == [1.0, 2.0, 3.0]
    spread = result.points[0].spread["p95_e2el_ms"]
    assert spread["low"] < spread["median"] < spread["high"]


def test_bad_settings() -> None:
    with pytest.raises(SweepError, match="--growth-factor"):
        SweepConfig(slo=SLO(), growth_factor=1.0)


def test_short_run_drain_is_not_runaway() -> None:
    from conveyor.bench.decide.sweep import runaway_reason
    cfg = SweepConfig(slo=SLO())
    # 8 requests at 1 req/s, 10 s median latency: duration 18 s, 0.44 req/s completed, yet no backlog.
    short = {"num_prompts": 8, "request_throughput": 0.44, "median_e2el_ms": 10_000.0, "error_rate": 0.0}
    assert runaway_reason(summary_from_json(short, "run", "test"), 1.0, cfg) is None
    long_run = {**short, "num_prompts": 200, "request_throughput": 0.3}
    assert "completed 0.3 req/s" in (runaway_reason(summary_from_json(long_run, "run", "test"), 1.0, cfg) or "")
    assert "error rate" in (runaway_reason(summary_from_json({**short, "error_rate": 0.6}, "run", "test"), 1.0, cfg) or "")


def test_cli_sweep_end_to_end_with_fake_runs(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from conveyor.bench.cli import sweep as cli_sweep

    monkeypatch.setattr(cli_sweep, "make_run_fn", lambda template: FakeServer(capacity=6.0))
    parser = argparse.ArgumentParser()
    cli_sweep.add_arguments(parser)
    args = parser.parse_args(["--base-url", "http://127.0.0.1:1", "--trace", "t.jsonl", "--slo", "e2e_p95_ms=1000",
                              "--out", str(tmp_path / "sw"), "--repeats", "1", "--bisect-steps", "1"])
    assert cli_sweep.run(args) == 0
    out = capsys.readouterr().out
    assert "Highest rate meeting the objective: 2.83 req/s (capacity [2.83, 4) req/s)" in out
    assert "Recommendation" in out and "Confidence: decided" in out
    assert (tmp_path / "sw" / "report" / "report.html").is_file()
    both = parser.parse_args(["--base-url", "http://x:1", "--server-command", "x {port}", "--trace", "t",
                              "--slo", "error_rate=0", "--out", str(tmp_path / "b")])
    assert cli_sweep.run(both) == 2


def test_concurrency_sweep_searches_whole_levels_and_sets_the_cap(tmp_path: pathlib.Path) -> None:
    from conveyor.bench.decide.sweep_axis import SweepAxis

    levels: list[float] = []

    def run(level: float, repeat: int, run_dir: pathlib.Path, num_requests: int | None = None) -> RunSummary:
        levels.append(level)
        run_dir.mkdir(parents=True, exist_ok=True)
        ttft = 100.0 * level  # passes up to 5 concurrent requests
        return summary_from_json({"p95_ttft_ms": ttft, "error_rate": 0.0, "request_throughput": level,
                                  "num_prompts": 10}, run_dir.name, "fake")

    from conveyor.bench.decide.slo import parse_slo_flag
    from conveyor.bench.decide.sweep import SweepConfig, run_sweep

    cfg = SweepConfig(slo=parse_slo_flag("ttft_p95_ms=500"), start_rate=1, num_repeats=1, bisect_steps=3,
                      axis=SweepAxis.CONCURRENCY)
    result = run_sweep("c", cfg, run, tmp_path, progress=lambda m: None)
    assert levels[:4] == [1.0, 2.0, 4.0, 8.0] and all(v == int(v) for v in levels)
    assert result.max_rate_meeting == 5.0 and (tmp_path / "concurrency-5-rep0").is_dir()
    assert len(levels) == len(set(levels))  # bisection stops when no whole level is left between
