"""The HTML report: one self-describing page, plots as PNG files beside it.

Sections, each with a stable id (tests check them): recommendation, checklist, diagnosis,
configurations, dashboard, plots (throughput, latency, timeseries, per-class), per-class table.
"""

from __future__ import annotations

import html
import pathlib

from conveyor.bench import plots
from conveyor.bench.report import (
    CONFIG_COLUMNS,
    DASHBOARD_COLUMNS,
    Analysis,
    config_rows,
    dashboard_rows,
)

SECTION_IDS = ("recommendation", "checklist", "diagnosis", "configurations", "dashboard", "plots", "per-class")

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: right; }
th { background: #f3f3f3; } td:first-child, td:nth-child(2) { text-align: left; }
.missed { color: #b00020; font-weight: bold; } .met { color: #1b7f3b; }
.yes { color: #1b7f3b; } .no { color: #b00020; } .unknown { color: #777; }
img { max-width: 100%; border: 1px solid #eee; margin: 0.5em 0; }
.rec { background: #eef7ee; padding: 1em; border-left: 4px solid #1b7f3b; }
"""


def _table(columns: tuple[str, ...] | list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = []
    for row in rows:
        cells = []
        for value in row:
            css = {"MISSED": "missed", "met": "met"}.get(value, "")
            cells.append(f'<td class="{css}">{html.escape(value)}</td>')
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _per_class_rows(analysis: Analysis) -> list[list[str]]:
    rows = []
    for config in analysis.configs:
        evaluated = config.operating_point or (config.points[-1] if config.points else None)
        if evaluated is None or not evaluated.point.runs:
            continue
        run = evaluated.point.runs[0]
        for name, values in sorted((run.summary.get("per_class") or {}).items()):
            rows.append([config.name, name, f"{run.offered_rate:g}"] + [
                "-" if values.get(k) is None else f"{float(values[k]):.4g}"
                for k in ("completed", "p95_ttft_ms", "p95_e2el_ms", "p95_itl_ms", "error_rate")])
    return rows


def _plots(analysis: Analysis, out_dir: pathlib.Path) -> list[pathlib.Path]:
    plot_dir = out_dir / "plots"
    return [
        plots.plot_throughput(analysis.points, plot_dir / "throughput.png"),
        plots.plot_latency(analysis.points, analysis.slo, plot_dir / "latency.png"),
        plots.plot_timeseries(analysis.configs, plot_dir / "timeseries.png"),
        plots.plot_per_class(analysis.configs, plot_dir / "per_class.png"),
    ]


def _objective_text(analysis: Analysis) -> str:
    if analysis.slo.is_empty():
        return "none set (give --slo): every run meets it and the choice rests on cost alone"
    return str(analysis.slo.to_dict())


def _section(section_id: str, title: str, body: str) -> str:
    return f'<section id="{section_id}"><h2>{html.escape(title)}</h2>{body}</section>'


def render_html(analysis: Analysis, plot_paths: list[pathlib.Path], out_dir: pathlib.Path) -> str:
    rec = analysis.recommendation
    checklist = "".join(
        f'<li><b class="{i.answer.value}">{i.answer.value}</b> {html.escape(i.question)}<br>'
        f"<small>{html.escape(i.evidence)}</small></li>" for i in analysis.checklist)
    findings = "".join(
        f"<li><b>{html.escape(f.symptom.value)}</b> ({html.escape(f.config_name)}): {html.escape(f.evidence)}."
        f"<br><small>Look at: {html.escape(f.remedy)}</small></li>" for f in analysis.findings
    ) or "<li>No symptom of the guide's five was found.</li>"
    images = "".join(f'<img src="{html.escape(str(p.relative_to(out_dir)))}" alt="{p.stem}">' for p in plot_paths)
    per_class_cols = ["Config", "Class", "Offered req/s", "Completed", "TTFT p95 ms", "E2E p95 ms",
                      "ITL p95 ms", "Error rate"]
    sections = [
        _section("recommendation", "Recommendation",
                 f'<p class="rec"><b>{html.escape(rec.recommended or "no configuration")}</b> '
                 f"({rec.outcome.value}). {html.escape(rec.explanation)}</p>"
                 f"<p>Objective: {html.escape(_objective_text(analysis))}</p>"),
        _section("checklist", "Decision checklist", f"<ul>{checklist}</ul>"),
        _section("diagnosis", "Diagnosis", f"<ul>{findings}</ul>"),
        _section("configurations", "Configurations", _table(CONFIG_COLUMNS, config_rows(analysis))),
        _section("dashboard", "Dashboard (one row per run)", _table(DASHBOARD_COLUMNS, dashboard_rows(analysis))),
        _section("plots", "Plots", images),
        _section("per-class", "Per-class breakdown (operating point)",
                 _table(per_class_cols, _per_class_rows(analysis))),
    ]
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>Conveyor report</title>"
            f"<style>{_STYLE}</style></head><body><h1>Conveyor report</h1>{''.join(sections)}</body></html>")


def write_html(analysis: Analysis, out_dir: pathlib.Path) -> pathlib.Path:
    plot_paths = _plots(analysis, out_dir)
    path = out_dir / "report.html"
    path.write_text(render_html(analysis, plot_paths, out_dir))
    return path
