"""Capacity is measured, not inferred: a point meets the objective at R only if the server sustained R."""

from __future__ import annotations

import json
import pathlib

from conveyor.bench.decide.decision import DecisionInputs, evaluate_configs
from conveyor.bench.decide.point_verdict import PointStatus
from conveyor.bench.decide.slo import SLO
from conveyor.bench.decide.sustained import grows, waiting_trend
from conveyor.bench.decide.sweep import SweepConfig, run_sweep
from conveyor.bench.measure.intervals import Interval, IntervalMethod
from conveyor.bench.measure.rundirs import discover_runs, group_points, load_run
from conveyor.bench.measure.summary import RunSummary, summary_from_json

SLO_TTFT = SLO(ttft_p95_ms=500)


def _ci(estimate: float, low: float, high: float) -> dict[str, object]:
    return Interval(estimate, low, high, 0.95, IntervalMethod.BOOTSTRAP_REQUESTS, 100).to_json()


def write_run(run_dir: pathlib.Path, rate: float, completed: tuple[float, float, float] | None = None,
              waiting: list[float] | None = None, ttft: float = 300.0) -> RunSummary:
    """A run at `rate` meeting p95 TTFT <= 500 ms, with its completed-rate interval and waiting series."""
    completed = completed or (rate, rate, rate)
    summary = {"label": f"{run_dir.parent.name}@{rate:g}#{run_dir.name[-1]}", "request_rate": rate,
               "num_prompts": 100, "completed": 100, "duration": 100 / rate, "request_throughput": completed[0],
               "p95_ttft_ms": ttft, "error_rate": 0.0, "valid": True, "server": {},
               "ci": {"p95_ttft_ms": _ci(ttft, ttft - 50, ttft + 50), "request_throughput": _ci(*completed)},
               "window": {"start_s": 0.0, "end_s": 100 / rate}}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir.parent / "sweep.json").write_text("{}")  # marks the directory as one configuration's
    (run_dir / "summary.json").write_text(json.dumps(summary))
    if waiting is not None:
        step = (100 / rate) / len(waiting)
        rows = [{"t_s": i * step, "num_requests_waiting": w} for i, w in enumerate(waiting)]
        (run_dir / "server_timeseries.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return summary_from_json(summary, run_dir.name, "test")  # type: ignore[arg-type]


def _point(root: pathlib.Path):
    configs = evaluate_configs(group_points(discover_runs([root])), DecisionInputs(slo=SLO_TTFT))
    return configs[0].points[0]


def test_a_growing_queue_is_not_capacity(tmp_path: pathlib.Path) -> None:
    growing = [float(i) for i in range(12)]  # waiting climbs all through the window
    write_run(tmp_path / "c" / "rate-2-rep0", 2.0, waiting=growing)
    trend = waiting_trend(load_run(tmp_path / "c" / "rate-2-rep0"))
    assert trend is not None and grows(trend)
    point = _point(tmp_path)
    assert point.status is PointStatus.UNDECIDED  # every latency bound is met, yet the queue grows
    assert "waiting grew from 1.5 to 9.5" in point.verdict.describe()
    flat = [1.0, 0.0, 2.0, 1.0, 0.0, 1.0, 2.0, 1.0, 0.0, 1.0, 1.0, 2.0]
    write_run(tmp_path / "f" / "c" / "rate-2-rep0", 2.0, waiting=flat)
    assert _point(tmp_path / "f").status is PointStatus.MET


def test_a_completed_rate_below_the_offered_one_is_not_capacity(tmp_path: pathlib.Path) -> None:
    # the burst: "meets the objective up to 18.3 req/s" while 11.8 [7.92, 16.6] req/s completed
    write_run(tmp_path / "c" / "rate-18.3-rep0", 18.3, completed=(11.8, 7.92, 16.6))
    point = _point(tmp_path)
    assert point.status is PointStatus.UNDECIDED
    assert "completed 11.8 [7.92, 16.6] req/s, below the offered 18.3" in point.verdict.describe()
    write_run(tmp_path / "k" / "c" / "rate-12-rep0", 12.0, completed=(11.8, 7.92, 16.6))  # covers 12: sustained
    assert _point(tmp_path / "k").status is PointStatus.MET


class Unsustained:
    """Meets the latency bound at every rate, but completes only 3 req/s: above 3 it is not sustained."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, int]] = []

    def __call__(self, rate: float, repeat: int, run_dir: pathlib.Path, num_requests: int | None = None) -> RunSummary:
        self.calls.append((rate, repeat))
        done = min(rate, 3.0)
        return write_run(run_dir, rate, completed=(done, 0.9 * done, 1.1 * done))


def test_the_sweep_repeats_an_unsustained_point_and_never_counts_it(tmp_path: pathlib.Path) -> None:
    client = Unsustained()
    cfg = SweepConfig(slo=SLO_TTFT, start_rate=1.0, bisect_steps=0, num_repeats=1, max_repeats=3, max_points=3)
    result = run_sweep("s", cfg, client, tmp_path, progress=lambda _: None)
    statuses = {p.rate: p.status for p in result.points}
    assert statuses == {1.0: "met", 2.0: "met", 4.0: "undecided"}
    assert client.calls.count((4.0, 2)) == 1  # repeated up to max_repeats while undecided
    assert result.max_rate_meeting == 2.0


def test_a_window_too_short_to_show_a_trend_is_not_capacity(tmp_path: pathlib.Path) -> None:
    # 40 requests at 8.33 req/s: a 4.8 s window holds 4 scrapes, too few to tell a backlog from a burst
    write_run(tmp_path / "c" / "rate-8.33-rep0", 8.33, waiting=[0.0, 0.0, 0.0, 0.0])
    point = _point(tmp_path)
    assert point.status is PointStatus.UNDECIDED
    assert "too short to show whether waiting grows (6 scrapes needed)" in point.verdict.describe()
    write_run(tmp_path / "n" / "c" / "rate-8.33-rep0", 8.33)  # no time series at all: the completed rate decides
    assert _point(tmp_path / "n").status is PointStatus.MET


def test_bounds_met_above_a_miss_without_sustaining_it_is_still_inconsistent(tmp_path: pathlib.Path) -> None:
    from conveyor.bench.decide.headline import not_ruled_out
    from conveyor.bench.decide.inconsistency import find_inconsistency

    write_run(tmp_path / "c" / "rate-1-rep0", 1.0, ttft=900.0)  # missed at 1 req/s
    write_run(tmp_path / "c" / "rate-4-rep0", 4.0, completed=(2.0, 1.5, 2.5))  # fast, but only 2 req/s done
    config = evaluate_configs(group_points(discover_runs([tmp_path])), DecisionInputs(slo=SLO_TTFT))[0]
    found = find_inconsistency(config)
    assert found is not None and "missed at 1 req/s but met every bound at 4 req/s" in found.describe()
    assert not_ruled_out(config)
    write_run(tmp_path / "d" / "c" / "rate-1-rep0", 1.0, ttft=900.0)
    write_run(tmp_path / "d" / "c" / "rate-4-rep0", 4.0, ttft=520.0)  # [470, 570] straddles 500: undecided
    consistent = evaluate_configs(group_points(discover_runs([tmp_path / "d"])), DecisionInputs(slo=SLO_TTFT))[0]
    assert find_inconsistency(consistent) is None and not not_ruled_out(consistent)  # missed below: ruled out


def _requests(run_dir: pathlib.Path, sends: list[float], e2e: list[float]) -> None:
    rows = [{"status": "completed", "sent_s": s, "end_s": s + e, "ttft_s": 0.3, "tpot_s": 0.03, "e2e_s": e,
             "itl_s": [0.03], "output_tokens": 100, "prompt_tokens": 100, "request_class": "chat",
             "request_id": f"r{i}", "in_window": True} for i, (s, e) in enumerate(zip(sends, e2e))]
    (run_dir / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_capacity_is_judged_against_the_sends_as_realized(tmp_path: pathlib.Path) -> None:
    """360 requests at a nominal 4 req/s whose seeded schedule spans 110 s (3.3 req/s), answers of 3-25 s:
    the server kept up with what it was sent, so the point is met; one whose answers grow with every send
    fell behind, and is not."""
    sends = [i * 110.0 / 359 for i in range(360)]
    spread = [3.0 + 22.0 * ((7 * i) % 360) / 359 for i in range(360)]
    write_run(tmp_path / "c" / "rate-4-rep0", 4.0, completed=(3.2, 2.8, 3.6))
    _requests(tmp_path / "c" / "rate-4-rep0", sends, spread)
    assert _point(tmp_path).status is PointStatus.MET
    write_run(tmp_path / "b" / "c" / "rate-4-rep0", 4.0, completed=(3.2, 2.8, 3.6))
    _requests(tmp_path / "b" / "c" / "rate-4-rep0", sends, [3.0 + 0.1 * i for i in range(360)])
    point = _point(tmp_path / "b")
    assert point.status is PointStatus.UNDECIDED
    assert "its sends would complete at" in point.verdict.describe()
