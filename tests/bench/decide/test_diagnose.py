"""Each diagnosis rule fires on the fixture showing its symptom and stays silent on a healthy one."""

from __future__ import annotations

import pathlib

import pytest

from conveyor.bench.decide.diagnose import Symptom, diagnose
from conveyor.bench.measure.rundirs import discover_runs, group_points

SYMPTOMS = pathlib.Path(__file__).parents[1] / "fixtures" / "symptoms"


def _findings(name: str):
    return diagnose(group_points(discover_runs([SYMPTOMS / name])))


def test_healthy_is_silent() -> None:
    assert _findings("healthy") == []


def test_invalid_runs_are_skipped() -> None:
    """A run whose client fell behind shows waiting, low KV and preemptions, but measured the client."""
    assert _findings("invalid_client") == []


@pytest.mark.parametrize(("fixture", "symptom", "cited"), [
    ("waiting_kv_low", Symptom.WAITING_WITH_FREE_KV, ["waiting peaks at 40", "20%", "max_num_seqs 4", "-> 30.0"]),
    ("long_ttft", Symptom.LONG_PROMPT_TTFT, ["'long_prefill'", "2400 ms", "13.3x"]),
    ("preemptions", Symptom.PREEMPTIONS_OR_OOM, ["12 preemptions", "99%", "1->0, 2->12"]),
    ("idle_client", Symptom.IDLE_WHILE_WAITING, ["CPU tokenization takes 120 ms", "60% of the median TTFT"]),
    ("over_admission", Symptom.THROUGHPUT_UP_P95_WORSE, ["big_batch completes 3.5", "+17%", "5000 vs 2000"]),
])
def test_rule_fires_citing_numbers(fixture: str, symptom: Symptom, cited: list[str]) -> None:
    findings = _findings(fixture)
    assert [f.symptom for f in findings] == [symptom]
    for text in cited:
        assert text in findings[0].evidence, findings[0].evidence
    assert findings[0].remedy
