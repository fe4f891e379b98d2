"""One cost, shown with its inputs, and no built-in price; a miss below a met rate is an inconsistency."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest

from conveyor.bench.decide.cost import Cost, CostBasis, CostModel
from conveyor.bench.decide.decision import (
    DecisionInputs,
    Outcome,
    cost_text,
    evaluate_configs,
    recommend,
)
from conveyor.bench.decide.decision_checklist import (
    Answer,
    ChecklistInputs,
    answer_checklist,
)
from conveyor.bench.decide.slo import SLO
from conveyor.bench.measure.intervals import Interval, IntervalConfig, IntervalMethod
from conveyor.bench.measure.run_stats import RequestSample, rate_intervals, steady_accepted_rate
from conveyor.bench.measure.rundirs import discover_runs, group_points
from conveyor.bench.report.dashboard import ReportInputs, analyze, config_rows

STUDY = pathlib.Path(__file__).parents[1] / "fixtures" / "study_ab"
SLO_AB = SLO(ttft_p95_ms=500, e2e_p95_ms=4000, error_rate=0.01)


def test_cost_is_price_times_gpus_times_time_over_accepted_with_its_interval() -> None:
    rate = Interval(4.0, 3.2, 5.0, 0.95, IntervalMethod.BOOTSTRAP_REQUESTS, 240)
    cost = Cost(CostModel(2.0, 2, "study.json"), run_time_s=60.0, num_accepted=240, accepted_rate=rate)
    per_second = 2.0 * 2 / 3600.0
    assert cost.per_accepted == pytest.approx(per_second * 60.0 / 240)
    assert cost.interval == pytest.approx((per_second / 5.0, per_second / 3.2))
    text = cost.describe()
    assert text.startswith("$0.278 [0.222, 0.347] per 1,000 accepted responses")
    assert "$2/GPU-hour from study.json × 2 GPUs × 0.0167 h / 240 accepted" in text
    unpriced = Cost(CostModel(), run_time_s=60.0, num_accepted=240, accepted_rate=rate)
    assert unpriced.per_accepted is None and unpriced.interval is None and unpriced.describe() == "no price given"


def _steady_run() -> list[RequestSample]:
    """100 requests at 1 req/s, each answered in 10 s: 10 s to fill the pipeline, 10 s to drain it after the
    last send; in between the server ends 1 request a second."""
    return [RequestSample(status="completed", sent_s=float(i), end_s=i + 10.0, e2e_s=10.0) for i in range(100)]


def test_the_cost_divides_the_price_by_the_steady_accepted_rate_not_the_whole_run() -> None:
    cfg = IntervalConfig(num_resamples=300)
    run = _steady_run()
    steady = steady_accepted_rate([run], None, cfg)
    assert steady is not None and steady.estimate == pytest.approx(1.0)
    cost = Cost(CostModel(3.6, 1, "test"), run_time_s=109.0, num_accepted=100,
                accepted_rate=rate_intervals([run], None, cfg)["request_throughput"], steady_rate=steady)
    per_second = 3.6 / 3600.0
    assert cost.basis is CostBasis.STEADY
    assert cost.per_accepted == pytest.approx(per_second / 1.0)  # $1 per 1,000
    assert cost.per_accepted_whole_run == pytest.approx(per_second * 109.0 / 100)  # fill and drain paid for
    # one quantity: the estimate and both ends are the price over the same rate's estimate and ends
    assert cost.interval == pytest.approx((per_second / steady.high, per_second / steady.low))
    low, high = cost.interval or (0.0, 0.0)
    assert low < cost.per_accepted < high
    assert cost.server_hour == pytest.approx(cost.per_accepted * steady.estimate * 3600.0) == pytest.approx(3.6)
    text = cost.describe()
    assert text.startswith("$1 [") and "per 1,000 accepted responses" in text
    assert "/ 1 [" in text and "accepted/s steady; whole run incl. fill and drain: $1.09" in text


def test_without_a_steady_window_the_cost_is_the_whole_runs_and_says_so() -> None:
    cfg = IntervalConfig(num_resamples=300)
    burst = [RequestSample(status="completed", sent_s=0.01 * i, end_s=30.0 + i, e2e_s=30.0 + i) for i in range(40)]
    steady = steady_accepted_rate([burst], None, cfg)
    cost = Cost(CostModel(3.6, 1, "test"), run_time_s=69.6, num_accepted=40,
                accepted_rate=rate_intervals([burst], None, cfg)["request_throughput"], steady_rate=steady)
    assert steady is None and cost.basis is CostBasis.WHOLE_RUN
    assert cost.per_accepted == cost.per_accepted_whole_run == pytest.approx(3.6 / 3600.0 * 69.6 / 40)
    low, high = cost.interval or (0.0, 0.0)
    assert low <= (cost.per_accepted or 0.0) <= high
    assert "whole run incl. fill and drain: no steady window measured" in cost.describe()
    assert "whole run: no steady window" in cost.short()


def test_without_a_price_the_decision_ranks_by_capacity_per_gpu_and_says_so() -> None:
    configs = evaluate_configs(group_points(discover_runs([STUDY])), DecisionInputs(slo=SLO_AB))  # no price
    assert all(c.cost_per_accepted is None for c in configs)
    rec = recommend(configs)
    assert rec.outcome is Outcome.WINNER and rec.recommended == "continuous" and not rec.priced
    assert "ranked by capacity per GPU" in rec.explanation and "no price given" in rec.explanation
    assert "per GPU is separated" in rec.confidence and "$" not in rec.explanation
    cheaper = answer_checklist(configs, rec, ChecklistInputs(main_rate=2.0))[-1]
    assert cheaper.answer is Answer.UNKNOWN and "no cost to compare" in cheaper.evidence


def test_no_default_price_is_used_anywhere(tmp_path: pathlib.Path) -> None:
    study = tmp_path / "study"
    shutil.copytree(STUDY, study)
    record = json.loads((study / "study.json").read_text())
    for config in record["configs"].values():
        config["price_per_gpu_hour"] = None
    (study / "study.json").write_text(json.dumps(record))
    analysis = analyze(ReportInputs((study,)))
    assert [row[4] for row in config_rows(analysis)] == ["no price given", "no price given",
                                                         "no operating point, so no cost"]
    priced = analyze(ReportInputs((study,), default_cost=CostModel(3.0, 1, "--price-per-gpu-hour")))
    assert "$3/GPU-hour from --price-per-gpu-hour" in config_rows(priced)[0][4]


def test_the_table_the_checklist_and_the_headline_show_one_cost() -> None:
    analysis = analyze(ReportInputs((STUDY,)))  # study.json prices every configuration
    continuous = analysis.configs[0]
    shown = cost_text(continuous)
    assert shown.startswith("$") and "from study.json" in shown
    assert config_rows(analysis)[0][4] == shown
    assert shown in analysis.checklist[4].evidence
    assert shown in analysis.recommendation.explanation


def test_a_miss_below_a_met_rate_is_an_inconsistent_measurement(tmp_path: pathlib.Path) -> None:
    shutil.copytree(STUDY / "continuous", tmp_path / "flaky")
    for rep in range(3):  # break rate 1 only: missed at 1, met at 2 and 4
        path = tmp_path / "flaky" / f"rate-1-rep{rep}" / "summary.json"
        summary = json.loads(path.read_text())
        summary.update(p95_ttft_ms=9000.0, started_at=f"2026-01-01T00:00:0{rep}")
        path.write_text(json.dumps(summary))
    for rep in range(3):
        path = tmp_path / "flaky" / f"rate-2-rep{rep}" / "summary.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "started_at": f"2026-01-01T00:01:0{rep}"}))
    configs = evaluate_configs(group_points(discover_runs([tmp_path])), DecisionInputs(slo=SLO_AB))
    rec = recommend(configs)
    assert rec.outcome is Outcome.UNDECIDED and rec.recommended is None
    assert "never meets" not in rec.explanation
    assert "flaky: inconsistent measurement: missed at 1 req/s but met at 2 req/s" in rec.explanation
    assert "the run order (2 req/s ran later" in rec.explanation and "too few" not in rec.explanation
    shutil.rmtree(tmp_path / "flaky" / "rate-1-rep1")
    shutil.rmtree(tmp_path / "flaky" / "rate-1-rep2")  # one repeat of 20 requests: a p95 that moves a lot
    rec = recommend(evaluate_configs(group_points(discover_runs([tmp_path])), DecisionInputs(slo=SLO_AB)))
    assert "too few requests (20 in 1 repeat(s) at 1 req/s)" in rec.explanation


def test_cheaper_compares_the_one_cost_and_the_servers_the_main_rate_needs() -> None:
    configs = evaluate_configs(group_points(discover_runs([STUDY])), DecisionInputs(
        slo=SLO_AB, costs={n: CostModel(2.0, 1, "study.json") for n in ("continuous", "static", "cheap_breaking")}))
    rec = recommend(configs)

    def cheaper(main_rate: float | None):  # type: ignore[no-untyped-def]
        return answer_checklist(configs, rec, ChecklistInputs(main_rate=main_rate))[-1]

    assert cheaper(None).answer is Answer.YES  # $0.139 vs $0.278 per 1,000 accepted responses
    at_six = cheaper(6.0)  # continuous: 2 servers ($4/hour); static: 3 ($6/hour)
    assert at_six.answer is Answer.YES and "continuous 2 server(s)" in at_six.evidence and "$6/hour" in at_six.evidence
    at_two = cheaper(2.0)  # one server each: the extra capacity is headroom, not a saving
    assert at_two.answer is Answer.NO and "no saving at the main rate" in at_two.evidence
