"""The objective: parsing from flags and files, and the verdict on a summary."""

from __future__ import annotations

import json
import pathlib

import pytest

from conveyor.bench.decide.slo import SLO, BoundStatus, SLOError, evaluate, parse_slo_flag, request_meets_goodput
from conveyor.bench.measure.run_stats import RequestSample
from conveyor.bench.measure.summary import RunSummary, summary_from_json


def _summary(**overrides: object) -> RunSummary:
    base: dict[str, object] = {"p95_ttft_ms": 400.0, "p95_itl_ms": 30.0, "p95_e2el_ms": 4000.0,
                               "error_rate": 0.0, "server": {"queue_time_p95_ms": 50.0}}
    base.update(overrides)
    return summary_from_json(base, "run", "test")  # type: ignore[arg-type]


def test_flag_parses_bounds() -> None:
    slo = parse_slo_flag("ttft_p95_ms=500, e2e_p95_ms=5000,error_rate=0.01,tpot_ms=50")
    assert slo == SLO(ttft_p95_ms=500, e2e_p95_ms=5000, error_rate=0.01, tpot_ms=50)
    assert slo.goodput_bounds() == {"tpot_ms": 50}


@pytest.mark.parametrize("text", ["ttft=500", "ttft_p95_ms", "ttft_p95_ms=abc", "error_rate=2"])
def test_bad_flag_names_the_problem(text: str) -> None:
    with pytest.raises(SLOError):
        parse_slo_flag(text)


def test_files(tmp_path: pathlib.Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps({"slo": {"ttft_p95_ms": 100}}))
    (tmp_path / "b.toml").write_text("queue_p95_ms = 20\nerror_rate = 0.05\n")
    assert parse_slo_flag(str(tmp_path / "a.json")) == SLO(ttft_p95_ms=100)
    assert parse_slo_flag(str(tmp_path / "b.toml")) == SLO(queue_p95_ms=20, error_rate=0.05)


def test_verdict_lists_every_bound() -> None:
    slo = SLO(ttft_p95_ms=500, e2e_p95_ms=3000, queue_p95_ms=100, error_rate=0.01)
    verdict = evaluate(slo, _summary())
    assert not verdict.passed
    assert [(c.name, c.status) for c in verdict.checks] == [
        ("ttft_p95_ms", BoundStatus.MET), ("e2e_p95_ms", BoundStatus.MISSED),
        ("queue_p95_ms", BoundStatus.MET), ("error_rate", BoundStatus.MET)]
    assert [c.name for c in verdict.failures] == ["e2e_p95_ms"]
    assert "4,000 ms" in verdict.describe()
    assert slo.evaluate(_summary(p95_e2el_ms=100.0)).passed


def test_missing_measurement_does_not_pass() -> None:
    verdict = evaluate(SLO(queue_p95_ms=100), _summary(server={"queue_time_p95_ms": None}))
    assert verdict.checks[0].status is BoundStatus.NO_DATA
    assert not verdict.passed


def test_goodput_per_request() -> None:
    slo = SLO(ttft_ms=100, e2el_ms=1000)
    ok = {"status": "completed", "ttft_s": 0.05, "tpot_s": 0.01, "e2e_s": 0.5}
    assert request_meets_goodput(slo, RequestSample.from_json(ok))
    assert not request_meets_goodput(slo, RequestSample.from_json({**ok, "ttft_s": 0.2}))
    assert not request_meets_goodput(slo, RequestSample.from_json({**ok, "status": "failed"}))
