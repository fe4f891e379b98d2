"""The report: every section, the dashboard in three formats, and readable PNGs."""

from __future__ import annotations

import argparse
import csv
import io
import json
import pathlib
import shutil

import pytest

from conveyor.bench.cli import report as cli_report
from conveyor.bench.report.dashboard import DASHBOARD_COLUMNS, ReportInputs, analyze, format_csv, format_markdown
from conveyor.bench.report.report_html import SECTION_IDS
from conveyor.bench.report.write import write_report

STUDY = pathlib.Path(__file__).parents[1] / "fixtures" / "study_ab"


def test_analysis_uses_the_study_objective_prices_and_order() -> None:
    analysis = analyze(ReportInputs((STUDY,)))
    assert analysis.slo.ttft_p95_ms == 500 and analysis.main_rate == 2.0
    assert [c.name for c in analysis.configs] == ["continuous", "static", "cheap_breaking"]
    assert analysis.recommendation.recommended == "continuous"


def test_dashboard_formats() -> None:
    analysis = analyze(ReportInputs((STUDY,)))
    rows = list(csv.reader(io.StringIO(format_csv(analysis))))
    assert tuple(rows[0]) == DASHBOARD_COLUMNS and len(rows) == 1 + 30
    assert rows[1][:4] == ["continuous", "continuous@1#0", "1", "1"]
    markdown = format_markdown(analysis)
    for heading in ("## Recommendation", "## Configurations", "## Dashboard", "Checklist:", "Diagnosis"):
        assert heading in markdown


def test_dashboard_shows_each_runs_peak_memory(tmp_path: pathlib.Path) -> None:
    """The summary's server.peak_gpu_memory_bytes is a dashboard column (the guide asks for peak GPU
    memory in every run's record); a run whose server reported none shows '-'."""
    study = tmp_path / "study"
    shutil.copytree(STUDY, study)
    summary_path = study / "continuous" / "rate-1-rep0" / "summary.json"
    summary = json.loads(summary_path.read_text())
    summary.setdefault("server", {})["peak_gpu_memory_bytes"] = 3 * 2**30
    summary_path.write_text(json.dumps(summary))
    rows = list(csv.reader(io.StringIO(format_csv(analyze(ReportInputs((study,)))))))
    column = rows[0].index("Peak memory")
    peaks = {row[1]: row[column] for row in rows[1:]}
    assert peaks["continuous@1#0"] == "3 GiB"
    assert sum(value == "-" for value in peaks.values()) == len(peaks) - 1


def test_html_has_every_section_and_pngs(tmp_path: pathlib.Path) -> None:
    paths = write_report(analyze(ReportInputs((STUDY,))), tmp_path)
    page = paths["html"].read_text()
    for section in SECTION_IDS:
        assert f'id="{section}"' in page
    for name in ("throughput", "latency", "timeseries", "per_class"):
        png = tmp_path / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
        assert f"plots/{name}.png" in page


def test_cli(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    cli_report.add_arguments(parser)
    args = parser.parse_args([str(STUDY), "--slo", "ttft_p95_ms=1", "--no-html", "--format", "markdown"])
    assert cli_report.run(args) == 0
    assert "No configuration meets every bound" in capsys.readouterr().out
    args = parser.parse_args([str(tmp_path)])
    assert cli_report.run(args) == 2
    assert "no run directory" in capsys.readouterr().err
