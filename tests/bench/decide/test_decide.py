"""Decisions you can defend: undecided verdicts, ties, the validity gate, adaptive repeats, fixed things."""

from __future__ import annotations

import json
import math
import pathlib

import pytest

from conveyor.bench.decide.decision import CostModel, DecisionInputs, Outcome, evaluate_configs, recommend
from conveyor.bench.decide.point_verdict import PointStatus
from conveyor.bench.decide.slo import SLO, BoundStatus, check_bound, evaluate
from conveyor.bench.decide.sweep import SweepConfig, run_sweep
from conveyor.bench.measure.intervals import Interval, IntervalMethod
from conveyor.bench.measure.rundirs import discover_runs, group_points
from conveyor.bench.measure.summary import RunSummary, summary_from_json
from conveyor.bench.report.dashboard import MixedRunsError, ReportInputs, analyze

SLO_TTFT = SLO(ttft_p95_ms=500)


def _ci(estimate: float, low: float, high: float) -> dict[str, object]:
    return Interval(estimate, low, high, 0.95, IntervalMethod.BOOTSTRAP_REQUESTS, 100).to_json()


def _summary(label: str, rate: float, ttft: tuple[float, float, float], **over: object) -> dict[str, object]:
    summary: dict[str, object] = {
        "label": label, "request_rate": rate, "num_prompts": 100, "completed": 100, "duration": 100 / rate,
        "request_throughput": rate, "p95_ttft_ms": ttft[0], "median_e2el_ms": 100.0, "error_rate": 0.0,
        "valid": True, "ci": {"p95_ttft_ms": _ci(*ttft)}, "server": {},
        "fixed": {"server_name": "conveyor", "server_version": "0.1.0", "weights_sha256": "aa", "trace_sha256": "t1"}}
    summary.update(over)
    return summary


def _typed(summary: dict[str, object]) -> RunSummary:
    return summary_from_json(summary, "run", "test")  # type: ignore[arg-type]


def _write(run_dir: pathlib.Path, summary: dict[str, object]) -> dict[str, object]:
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return summary


def _sweep_dir(root: pathlib.Path, name: str, points: dict[float, tuple[float, float, float]]) -> None:
    (root / name).mkdir(parents=True)
    (root / name / "sweep.json").write_text("{}")
    for rate, ttft in points.items():
        _write(root / name / f"rate-{rate:g}-rep0", _summary(f"{name}@{rate:g}", rate, ttft))


def test_an_interval_straddling_the_bound_is_undecided() -> None:
    assert check_bound("ttft_p95_ms", 500, 450, Interval(450, 400, 520, 0.95, IntervalMethod.NONE, 9)).status \
        is BoundStatus.UNDECIDED
    verdicts = {t: evaluate(SLO_TTFT, _typed(_summary("r", 1, t))).status for t in
                [(450, 400, 499), (450, 400, 520), (560, 510, 600)]}
    assert list(verdicts.values()) == [BoundStatus.MET, BoundStatus.UNDECIDED, BoundStatus.MISSED]
    no_upper = evaluate(SLO_TTFT, _typed(_summary("r", 1, (300, 250, math.inf))))  # too few requests for a p95
    assert no_upper.status is BoundStatus.UNDECIDED and "unbounded" in no_upper.describe()


def _decide(root: pathlib.Path, costs: dict[str, CostModel] | None = None):
    configs = evaluate_configs(group_points(discover_runs([root])), DecisionInputs(slo=SLO_TTFT, costs=costs or {}))
    return configs, recommend(configs)


def test_overlapping_capacities_tie_and_separated_ones_do_not(tmp_path: pathlib.Path) -> None:
    met, undecided, missed = (300, 250, 350), (480, 420, 560), (900, 800, 1000)
    _sweep_dir(tmp_path / "a", "base", {1: met, 2: met, 4: missed})
    _sweep_dir(tmp_path / "a", "variant", {1: met, 2: undecided, 4: missed})  # capacity [1, 4) overlaps [2, 4)
    configs, rec = _decide(tmp_path / "a")
    assert [c.capacity.describe() for c in configs] == ["[2, 4) req/s", "[1, 4) req/s"]
    assert configs[1].points[1].status is PointStatus.UNDECIDED
    assert rec.outcome is Outcome.TIE and rec.tied == ("base", "variant") and rec.recommended == "base"
    assert rec.confidence.startswith("tie: base, variant cannot be separated")
    _sweep_dir(tmp_path / "b", "base", {1: met, 2: met, 4: missed})
    _sweep_dir(tmp_path / "b", "variant", {1: met, 2: missed})  # capacity [1, 2): below base's [2, 4)
    configs, rec = _decide(tmp_path / "b")
    assert rec.outcome is Outcome.WINNER and rec.recommended == "base" and rec.confidence.startswith("decided")
    # the same capacities, but the variant costs a quarter: per dollar it is [4, 8) vs [2, 4): it wins.
    # Both need a price: there is no built-in one, and without a price for each the ranking is per GPU.
    configs, rec = _decide(tmp_path / "b", {"base": CostModel(1.0), "variant": CostModel(0.25)})
    assert rec.outcome is Outcome.WINNER and rec.recommended == "variant"


def test_nothing_decided_is_said_undecided(tmp_path: pathlib.Path) -> None:
    _sweep_dir(tmp_path, "only", {1: (480, 420, 560), 2: (900, 800, 1000)})
    _, rec = _decide(tmp_path)
    assert rec.outcome is Outcome.UNDECIDED and rec.recommended is None and "undecided" in rec.explanation


class FlakyClient:
    """Repeat 0 of every rate is invalid the first time (send lag), then valid; p95 TTFT = 100 x rate."""

    def __init__(self, undecided_at: float | None = None, always_invalid: bool = False) -> None:
        self.calls: list[tuple[float, int]] = []
        self.undecided_at, self.always_invalid = undecided_at, always_invalid

    def __call__(self, rate: float, repeat: int, run_dir: pathlib.Path, num_requests: int | None = None) -> RunSummary:
        self.calls.append((rate, repeat))
        first = self.calls.count((rate, repeat)) == 1
        invalid = self.always_invalid or (repeat == 0 and first)
        width = 200.0 if rate == self.undecided_at else 20.0
        ttft = 100.0 * rate
        summary = _summary(f"s@{rate}#{repeat}", rate, (ttft, ttft - width, ttft + width), valid=not invalid,
                           invalid_reason="p99 send lag 80 ms exceeds the 10 ms bound" if invalid else None)
        return summary_from_json(_write(run_dir, summary), run_dir.name, "fake")  # type: ignore[arg-type]


def test_sweep_reruns_invalid_runs_and_never_counts_them(tmp_path: pathlib.Path) -> None:
    client = FlakyClient()
    cfg = SweepConfig(slo=SLO_TTFT, start_rate=1.0, bisect_steps=0, num_repeats=1, max_repeats=1)
    result = run_sweep("s", cfg, client, tmp_path, progress=lambda _: None)
    assert [p.rate for p in result.points] == [1.0, 2.0, 4.0, 8.0]  # 8 (800 ms) is missed
    assert all(p.invalid_dirs == [f"rate-{p.rate:g}-rep0-invalid1"] for p in result.points)
    assert client.calls[:2] == [(1.0, 0), (1.0, 0)] and result.max_rate_meeting == 4.0
    assert (tmp_path / "rate-1-rep0-invalid1" / "summary.json").is_file()
    analysis = analyze(ReportInputs((tmp_path,), SLO_TTFT))
    point = analysis.configs[0].points[0]
    assert point.status is PointStatus.MET and point.invalid_runs == ["s@1.0#0"] and len(point.valid_runs) == 1


def test_an_always_invalid_point_is_neither_pass_nor_fail(tmp_path: pathlib.Path) -> None:
    cfg = SweepConfig(slo=SLO_TTFT, start_rate=1.0, bisect_steps=0, num_repeats=1, max_repeats=1,
                      max_invalid_reruns=1)
    result = run_sweep("s", cfg, FlakyClient(always_invalid=True), tmp_path, progress=lambda _: None)
    assert [p.status for p in result.points] == ["invalid", "invalid"]  # 1, then downward to 0.5: no evidence
    assert result.max_rate_meeting is None and not any(p.passed for p in result.points)


def test_undecided_point_gets_more_repeats_within_budget(tmp_path: pathlib.Path) -> None:
    client = FlakyClient(undecided_at=4.0)
    cfg = SweepConfig(slo=SLO_TTFT, start_rate=2.0, bisect_steps=0, num_repeats=1, max_repeats=3,
                      max_invalid_reruns=1)
    result = run_sweep("s", cfg, client, tmp_path, progress=lambda _: None)
    by_rate = {p.rate: p for p in result.points}
    assert len(by_rate[2.0].run_dirs) == 1  # decided at once
    assert len(by_rate[4.0].run_dirs) == 3 and by_rate[4.0].status == "undecided"  # budget spent
    assert by_rate[4.0].failures and "undecided" in by_rate[4.0].failures[0]
    timed = SweepConfig(slo=SLO_TTFT, start_rate=4.0, bisect_steps=0, num_repeats=1, max_repeats=5,
                        max_duration_s=30.0, max_points=1)  # 25 s per run: a second run, then the budget is spent
    result = run_sweep("t", timed, FlakyClient(undecided_at=4.0), tmp_path / "t", progress=lambda _: None)
    assert len(result.points[0].run_dirs) == 2


def _fixed_run(root: pathlib.Path, config: str, rate: float, **fixed: str) -> None:
    summary = _summary(f"{config}@{rate:g}", rate, (300, 250, 350))
    summary["fixed"] = {**summary["fixed"], **fixed}  # type: ignore[dict-item]
    (root / config).mkdir(parents=True, exist_ok=True)
    (root / config / "sweep.json").write_text("{}")
    _write(root / config / f"rate-{rate:g}-rep0", summary)


def test_report_refuses_runs_whose_fixed_things_differ(tmp_path: pathlib.Path) -> None:
    _fixed_run(tmp_path, "a", 1.0)
    _fixed_run(tmp_path, "b", 1.0, weights_sha256="bb", server_version="0.2.0")
    with pytest.raises(MixedRunsError, match="weights_sha256 differs: aa .*; bb"):
        analyze(ReportInputs((tmp_path,), SLO_TTFT))
    mixed = analyze(ReportInputs((tmp_path,), SLO_TTFT, allow_mixed=True))
    assert {d.key for d in mixed.fixed_differences} == {"server_version", "weights_sha256"}
    q4 = mixed.checklist[3]
    assert q4.answer.value == "no" and "weights_sha256 differs" in q4.evidence
    # a study that varies the weights on purpose (a `model` variant) is exempt for that key only
    (tmp_path / "study.json").write_text(json.dumps({"configs": {
        "a": {"varies": []}, "b": {"varies": ["model_path", "weights_sha256"]}}}))
    with pytest.raises(MixedRunsError, match="server_version") as error:
        analyze(ReportInputs((tmp_path,), SLO_TTFT))
    assert "weights_sha256" not in str(error.value)


def test_unknown_fixed_things_never_differ_but_leave_q4_unknown(tmp_path: pathlib.Path) -> None:
    _fixed_run(tmp_path, "a", 1.0)
    _fixed_run(tmp_path, "a", 2.0, weights_sha256=None)  # type: ignore[arg-type]
    analysis = analyze(ReportInputs((tmp_path,), SLO_TTFT))
    assert analysis.fixed_differences == [] and "weights_sha256" in analysis.fixed_unknown


def _context_run(root: pathlib.Path, config: str, context: int) -> None:
    summary = _summary(f"{config}@1", 1.0, (300, 250, 350), server={"num_preemptions": 0, "kv_cache_usage_max": 0.6})
    (root / config).mkdir(parents=True)
    (root / config / "sweep.json").write_text("{}")
    run_dir = root / config / "rate-1-rep0"
    _write(run_dir, summary)
    rows = [{"request_id": str(i), "status": "completed", "prompt_tokens": context - 10, "output_tokens": 10}
            for i in range(3)]
    (run_dir / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_kv_question_is_answered_at_the_planned_context_length(tmp_path: pathlib.Path) -> None:
    from conveyor.bench.decide.decision_checklist import Answer, ChecklistInputs, kv_stability

    _context_run(tmp_path, "base", 400)
    configs, _ = _decide(tmp_path)
    short = kv_stability(configs, configs[0], 8192)
    assert short.answer is Answer.UNKNOWN and "planned 8,192 tokens were not reached" in short.evidence
    assert kv_stability(configs, configs[0], None).answer is Answer.YES
    _context_run(tmp_path, "ctx8k", 9000)  # a study variant whose trace reaches the planned context
    configs, rec = _decide(tmp_path)
    answer = kv_stability(configs, configs[0], 8192)
    assert answer.answer is Answer.YES and answer.evidence.startswith("ctx8k") and "9,000 tokens" in answer.evidence
    assert isinstance(ChecklistInputs(planned_context_len=8192).planned_context_len, int)


def test_a_variant_may_change_the_trace_and_is_exempt_for_it() -> None:
    from conveyor.bench.decide.study import spec_from_mapping, study_record

    spec = spec_from_mapping({"command": "x {port} {args}", "trace": "short.jsonl", "planned_context_len": 8192,
                              "baseline": {"max_num_seqs": 8},
                              "variants": [{"name": "ctx8k", "trace": "long.jsonl"},
                                           {"name": "h100", "max_num_seqs": 4, "price_per_gpu_hour": 2.0}]}, "t")
    ctx, h100 = spec.variants[1], spec.variants[2]
    assert (ctx.changed, ctx.trace_path, ctx.args) == ("trace", "long.jsonl", {"max_num_seqs": 8})
    assert ctx.varied_fixed_keys() == ["trace_sha256"] and h100.varied_fixed_keys() == ["gpu_name", "gpu_count"]
    record = study_record(spec)
    assert record["planned_context_len"] == 8192 and record["configs"]["ctx8k"]["trace"] == "long.jsonl"
