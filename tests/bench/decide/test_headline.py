"""The recommendation at a glance: a headline, reasons, and a confidence the checklist cannot contradict."""

from __future__ import annotations

import json
import pathlib

from conveyor.bench.decide.decision import DecisionInputs, Outcome, evaluate_configs
from conveyor.bench.decide.decision_checklist import Answer, ChecklistInputs
from conveyor.bench.decide.headline import decide
from conveyor.bench.decide.slo import SLO
from conveyor.bench.measure.intervals import Interval, IntervalMethod
from conveyor.bench.measure.rundirs import discover_runs, group_points
from conveyor.bench.report.dashboard import (
    ReportInputs,
    analyze,
    format_markdown,
    format_terminal,
)

STUDY = pathlib.Path(__file__).parents[1] / "fixtures" / "study_ab"
SLO_TTFT = SLO(ttft_p95_ms=500)


def _run(root: pathlib.Path, config: str, rate: float, ttft: tuple[float, float, float]) -> None:
    ci = {"p95_ttft_ms": Interval(*ttft, 0.95, IntervalMethod.BOOTSTRAP_REQUESTS, 100).to_json()}
    summary = {"label": f"{config}@{rate:g}", "request_rate": rate, "num_prompts": 100, "completed": 100,
               "duration": 100 / rate, "request_throughput": rate, "p95_ttft_ms": ttft[0], "error_rate": 0.0,
               "valid": True, "ci": ci, "server": {}}
    run_dir = root / config / f"rate-{rate:g}-rep0"
    run_dir.mkdir(parents=True)
    (root / config / "sweep.json").write_text("{}")  # marks the directory as one configuration's
    (run_dir / "summary.json").write_text(json.dumps(summary))


def _consistent(confidence: str, outcome: Outcome, main: Answer) -> bool:
    """The shared rule: a winner is "decided" only when the checklist's main scenario is "yes"."""
    return not (outcome is Outcome.WINNER and confidence.startswith("decided") and main is not Answer.YES)


def test_an_unknown_main_scenario_makes_a_separated_winner_provisional(tmp_path: pathlib.Path) -> None:
    met, undecided, missed = (300, 250, 350), (480, 420, 560), (900, 800, 1000)
    for rate, ttft in {0.5: undecided, 1: met, 2: met, 4: missed}.items():
        _run(tmp_path, "base", rate, ttft)
    for rate, ttft in {0.5: met, 1: missed}.items():
        _run(tmp_path, "small", rate, ttft)
    configs = evaluate_configs(group_points(discover_runs([tmp_path])), DecisionInputs(slo=SLO_TTFT))
    decision = decide(configs, ChecklistInputs(main_rate=0.5))  # base is undecided at the main rate
    rec = decision.recommendation
    assert rec.outcome is Outcome.WINNER and rec.recommended == "base"
    assert decision.checklist[0].answer is Answer.UNKNOWN
    assert rec.confidence.startswith("provisional: base is separated") and "main scenario is unknown" in rec.confidence
    assert decision.headline == ("base: capacity [2, 4) req/s, no price given (ranked by capacity per GPU); "
                                 "confidence: provisional")
    assert _consistent(rec.confidence, rec.outcome, decision.checklist[0].answer)
    decided = decide(configs, ChecklistInputs(main_rate=2.0))  # met at the main rate: decided
    assert decided.checklist[0].answer is Answer.YES and decided.recommendation.confidence.startswith("decided")


def test_the_report_leads_with_the_headline_then_the_reasons() -> None:
    analysis = analyze(ReportInputs((STUDY,)))
    rec = analysis.recommendation
    assert analysis.headline.startswith("continuous: capacity [4, 8) req/s, cost $")
    # the fixtures hold no requests.jsonl, so no steady window: the cost is the whole run's, and says so
    assert analysis.headline.endswith("per 1,000 accepted responses at $2/GPU-hour (study.json, whole run: "
                                      "no steady window); confidence: decided")
    cost = analysis.configs[0].cost
    assert cost is not None and cost.short() in analysis.headline and cost.describe() in rec.reasons[0]
    assert _consistent(rec.confidence, rec.outcome, analysis.checklist[0].answer)
    assert len(rec.reasons) == 3 and rec.reasons[0].startswith("continuous: meets the objective")
    text = format_terminal(analysis)
    assert f"Recommendation: {analysis.headline}\nBecause:\n- {rec.reasons[0]}\n" in text
    assert f"**{analysis.headline}**\n\n- {rec.reasons[0]}" in format_markdown(analysis)


def test_a_configuration_not_ruled_out_keeps_the_winner_provisional(tmp_path: pathlib.Path) -> None:
    _run(tmp_path, "base", 1, (480, 420, 560))  # undecided at the only rate: no operating point, not ruled out
    _run(tmp_path, "small", 1, (300, 250, 350))
    configs = evaluate_configs(group_points(discover_runs([tmp_path])), DecisionInputs(slo=SLO_TTFT))
    decision = decide(configs, ChecklistInputs(main_rate=1.0))
    rec = decision.recommendation
    assert rec.outcome is Outcome.WINNER and rec.recommended == "small"
    assert decision.checklist[0].answer is Answer.YES
    assert rec.confidence.startswith("provisional: small is separated") and "base is not ruled out" in rec.confidence
