"""The decision on recorded fixture run directories."""

from __future__ import annotations

import pathlib
import shutil

import pytest

from conveyor.bench.decide.decision import CostModel, DecisionInputs, Outcome, evaluate_configs, recommend
from conveyor.bench.decide.decision_checklist import Answer, ChecklistInputs, answer_checklist
from conveyor.bench.decide.slo import SLO
from conveyor.bench.measure.rundirs import discover_runs, find_study_file, group_points

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures"
STUDY = FIXTURES / "study_ab"
SLO_AB = SLO(ttft_p95_ms=500, e2e_p95_ms=4000, error_rate=0.01)
PRICES = {"continuous": CostModel(2.0), "static": CostModel(2.0), "cheap_breaking": CostModel(0.5)}


def _configs(paths: list[pathlib.Path], slo: SLO = SLO_AB, costs: dict[str, CostModel] | None = None):
    points = group_points(discover_runs(paths))
    return evaluate_configs(points, DecisionInputs(slo=slo, costs=PRICES if costs is None else costs))


def test_runs_group_by_config_and_rate() -> None:
    points = group_points(discover_runs([STUDY]))
    assert sorted(points) == ["cheap_breaking", "continuous", "static"]
    assert [p.offered_rate for p in points["continuous"]] == [1.0, 2.0, 4.0, 8.0]
    assert all(len(p.runs) == 3 for p in points["continuous"])
    assert find_study_file([STUDY]).main_rate == 2.0
    assert len(discover_runs([STUDY, STUDY / "static"])) == len(discover_runs([STUDY])) == 30


def test_cheapest_meeting_every_bound_wins() -> None:
    configs = {c.name: c for c in _configs([STUDY])}
    assert configs["continuous"].max_rate_meeting == 4.0
    assert configs["static"].max_rate_meeting == 2.0
    assert configs["cheap_breaking"].max_rate_meeting is None
    # 3 repeats x 20 s at $2/h over 3 x 80 accepted responses.
    assert configs["continuous"].cost_per_accepted == pytest.approx(2.0 * 60 / 3600 / 240)
    rec = recommend(list(configs.values()))
    assert rec.outcome is Outcome.WINNER and rec.recommended == "continuous"
    assert "cheap_breaking never meets the objective" in rec.explanation
    assert rec.confidence.startswith("decided")


def test_cheaper_but_breaking_never_wins() -> None:
    # Make the breaking configuration nearly free: it still cannot win.
    costs = {**PRICES, "cheap_breaking": CostModel(0.0001)}
    rec = recommend(_configs([STUDY], costs=costs))
    assert rec.recommended == "continuous"


def test_tie_is_said_and_broken_by_study_order(tmp_path: pathlib.Path) -> None:
    shutil.copytree(STUDY / "continuous", tmp_path / "twin")
    shutil.copytree(STUDY / "continuous", tmp_path / "continuous")
    configs = sorted(_configs([tmp_path], costs={}), key=lambda c: c.name != "twin")  # study order: twin first
    rec = recommend(configs)
    assert rec.outcome is Outcome.TIE
    assert rec.tied == ("twin", "continuous") and rec.recommended == "twin"
    # no price given: ranked, and tied, by capacity per GPU (there is no built-in price)
    assert "capacity intervals (per GPU) overlap" in rec.explanation and "baseline first" in rec.explanation
    assert rec.confidence.startswith("tie:")
    cheaper = answer_checklist(configs, rec, ChecklistInputs())[-1]
    assert cheaper.answer is Answer.NO and "a tie" in cheaper.evidence


def test_no_winner_names_the_closest() -> None:
    impossible = SLO(ttft_p95_ms=1.0)
    rec = recommend(_configs([STUDY], slo=impossible))
    assert rec.outcome is Outcome.NO_WINNER and rec.recommended is None
    assert "No configuration meets every bound" in rec.explanation and "Closest" in rec.explanation


def test_checklist_answers_with_evidence() -> None:
    configs = _configs([STUDY])
    rec = recommend(configs)
    items = answer_checklist(configs, rec, ChecklistInputs(main_rate=2.0))
    answers = [i.answer for i in items]
    # main scenario met; 8 req/s blows latency up (no rejection); KV stable; repeats within 15%; not
    # cheaper at the main rate of 2 req/s: one server either way, continuous leaves half of it unused.
    assert answers == [Answer.YES, Answer.NO, Answer.YES, Answer.YES, Answer.NO]
    assert "50% of their capacity unused" in items[4].evidence and "no saving" in items[4].evidence
    from conveyor.bench.report.dashboard import ReportInputs, analyze
    q4 = analyze(ReportInputs((STUDY,))).checklist[3]  # the fixtures record no fixed things
    assert q4.answer is Answer.UNKNOWN and "unknown: server_name" in q4.evidence
    assert "blow-up" in items[1].evidence and "operating point 4" in items[1].evidence
    static = next(c for c in configs if c.name == "static")
    from conveyor.bench.decide.decision_checklist import burst
    assert burst(static).answer is Answer.YES and "rejected" in burst(static).evidence


def test_goodput_bounds_count_accepted_from_requests(tmp_path: pathlib.Path) -> None:
    import json
    run = tmp_path / "r"
    shutil.copytree(STUDY / "continuous" / "rate-1-rep0", run)
    records = [{"status": "completed", "ttft_s": t, "tpot_s": 0.01, "e2e_s": 1.0} for t in (0.1, 0.2, 0.9)]
    (run / "requests.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    from conveyor.bench.decide.decision import accepted_responses
    from conveyor.bench.measure.rundirs import load_run
    assert accepted_responses(load_run(run), SLO(ttft_ms=500)) == 2
    assert accepted_responses(load_run(run), SLO()) == 20


def test_invalid_run_counts_neither_way(tmp_path: pathlib.Path) -> None:
    """The validity gate: an invalid repeat is set aside; a point with no valid repeat is invalid, never met
    or missed, and the operating point is found among the others."""
    import json

    from conveyor.bench.decide.point_verdict import PointStatus
    shutil.copytree(STUDY / "continuous", tmp_path / "continuous")

    def invalidate(run: str, **values: object) -> None:
        path = tmp_path / "continuous" / run / "summary.json"
        summary = json.loads(path.read_text())
        summary.update(valid=False, invalid_reason="p99 send lag 80 ms exceeds the 10 ms bound", **values)
        path.write_text(json.dumps(summary))

    invalidate("rate-4-rep1", p95_ttft_ms=9000.0)  # an invalid run's miss is not evidence
    config = _configs([tmp_path])[0]
    assert config.max_rate_meeting == 4.0 and config.points[2].invalid_runs == ["continuous@4#1"]
    assert len(config.points[2].valid_runs) == 2
    for rep in range(3):
        invalidate(f"rate-8-rep{rep}")  # the overloaded point: invalid, so no longer a miss
    config = _configs([tmp_path])[0]
    assert config.points[3].status is PointStatus.INVALID
    assert config.capacity.high == float("inf") and config.max_rate_meeting == 4.0
