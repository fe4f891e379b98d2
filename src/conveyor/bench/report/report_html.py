"""The HTML report: one self-contained page (plots embedded as data URIs; also kept as PNG files).

Sections, each with a stable id (tests check them): recommendation (with its confidence and the
objective as a sentence), checklist, diagnosis, configurations, gpus (only when the runs span several GPUs
or prices were given per GPU: the dashboard per GPU), points (valid repeats pooled, with
intervals), dashboard (one row per run; invalid runs greyed out), fixed (the fixed things), cache (the
runs' prefix-cache state and warnings), plots (throughput, latency, timeseries, per-class), per-class table.
"""

from __future__ import annotations

import base64
import html
import pathlib

from conveyor.bench.decide.slo import describe_objective
from conveyor.bench.report import plots
from conveyor.bench.report.dashboard import (
    CONFIG_COLUMNS,
    DASHBOARD_COLUMNS,
    POINT_COLUMNS,
    SPEC_COLUMNS,
    Analysis,
    cache_lines,
    config_rows,
    dashboard_rows,
    fixed_lines,
    point_rows,
    spec_rows,
)
from conveyor.bench.report.gpu_report import GPU_COLUMNS, gpu_lines, gpu_rows, shows_gpus
from conveyor.bench.report.report_format import class_cell

SECTION_IDS = ("recommendation", "checklist", "diagnosis", "configurations", "points", "dashboard", "fixed",
               "cache", "plots", "per-class")

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; line-height: 1.4; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.88em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: right; white-space: nowrap; }
th { background: #f3f3f3; } td:first-child, td:nth-child(2) { text-align: left; }
.missed { color: #b00020; font-weight: bold; } .met { color: #1b7f3b; } .undecided { color: #a66a00; }
tr.invalid td { color: #999; background: #f6f6f6; font-style: italic; }
.yes { color: #1b7f3b; } .no { color: #b00020; } .unknown { color: #777; }
img { max-width: 100%; border: 1px solid #eee; margin: 0.5em 0; }
.rec { background: #eef7ee; padding: 1em; border-left: 4px solid #1b7f3b; }
.rec.tie, .rec.undecided { background: #fff7e6; border-color: #a66a00; }
.rec.no_winner { background: #fdecee; border-color: #b00020; }
.note { color: #555; font-size: 0.9em; }
"""

_CELL_CLASS = {"MISSED": "missed", "met": "met", "undecided": "undecided"}


def _table(columns: tuple[str, ...] | list[str], rows: list[list[str]], grey_invalid: bool = False) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = []
    for row in rows:
        invalid = grey_invalid and row[-1].startswith("INVALID")
        cells = "".join(f'<td class="{_CELL_CLASS.get(v, "")}">{html.escape(v)}</td>' for v in row)
        body.append(f'<tr class="{"invalid" if invalid else ""}">{cells}</tr>')
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _per_class_rows(analysis: Analysis) -> list[list[str]]:
    rows = []
    for config in analysis.configs:
        evaluated = config.operating_point or next((p for p in reversed(config.points) if p.valid_runs), None)
        if evaluated is None or not evaluated.valid_runs:
            continue
        run = evaluated.valid_runs[0]
        for name, values in sorted(run.summary.per_class.items()):
            rows.append([config.name, name, f"{run.offered_rate:.3g}", f"{values.completed}"] + [
                class_cell(values, k) for k in ("p95_ttft_ms", "p95_e2el_ms", "error_rate")])
    return rows


def _plots(analysis: Analysis, out_dir: pathlib.Path) -> list[pathlib.Path]:
    plot_dir = out_dir / "plots"
    return [
        plots.plot_throughput(analysis.configs, plot_dir / "throughput.png"),
        plots.plot_latency(analysis.configs, analysis.slo, plot_dir / "latency.png"),
        plots.plot_timeseries(analysis.configs, plot_dir / "timeseries.png"),
        plots.plot_per_class(analysis.configs, plot_dir / "per_class.png"),
    ]


def _embedded(path: pathlib.Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img src="data:image/png;base64,{data}" alt="{html.escape(path.stem)}" title="plots/{path.name}">'


def _section(section_id: str, title: str, body: str) -> str:
    return f'<section id="{section_id}"><h2>{html.escape(title)}</h2>{body}</section>'


def _recommendation(analysis: Analysis) -> str:
    rec = analysis.recommendation
    reasons = "".join(f"<li>{html.escape(r)}</li>" for r in rec.reasons)
    return (f'<div class="rec {rec.outcome.value}"><p><b>{html.escape(analysis.headline)}</b></p>'
            f"<ul>{reasons}</ul><p><b>Confidence:</b> {html.escape(rec.confidence)}</p></div>"
            f"<p><b>Objective:</b> {html.escape(describe_objective(analysis.slo))}</p>"
            '<p class="note">Every number comes with its 95% confidence interval [low, high] (bootstrap over '
            "requests and repeats; error rates: Clopper-Pearson). A bound is met when the whole interval is "
            "under it, missed when the whole interval is over it, undecided otherwise. Invalid runs (the client "
            "could not keep up) are greyed out and counted nowhere.</p>")


def _gpus(analysis: Analysis) -> str:
    lines = "".join(f"<p>{html.escape(line)}</p>" for line in gpu_lines(analysis.gpus, analysis.gpu_prices))
    return lines + _table(GPU_COLUMNS, gpu_rows(analysis.configs, analysis.gpus))


def render_html(analysis: Analysis, plot_paths: list[pathlib.Path]) -> str:
    checklist = "".join(
        f'<li><b class="{i.answer.value}">{i.answer.value}</b> {html.escape(i.question)}<br>'
        f"<small>{html.escape(i.evidence)}</small></li>" for i in analysis.checklist)
    findings = "".join(
        f"<li><b>{html.escape(f.symptom.value)}</b> ({html.escape(f.config_name)}): {html.escape(f.evidence)}."
        f"<br><small>Look at: {html.escape(f.remedy)}</small></li>" for f in analysis.findings
    ) or "<li>No symptom of the guide's five was found in the valid runs.</li>"
    per_class_cols = ["Config", "Class", "Offered req/s", "Completed", "TTFT p95", "E2E p95", "Error rate"]
    spec = spec_rows(analysis)
    sections = [
        _section("recommendation", "Recommendation", _recommendation(analysis)),
        _section("checklist", "Decision checklist", f"<ul>{checklist}</ul>"),
        _section("diagnosis", "Diagnosis", f"<ul>{findings}</ul>"),
        _section("configurations", "Configurations", _table(CONFIG_COLUMNS, config_rows(analysis))),
        *([_section("gpus", "Per GPU (valid runs)", _gpus(analysis))] if shows_gpus(analysis.gpus, analysis.gpu_prices)
          else []),
        _section("points", "Points (valid repeats pooled)", _table(POINT_COLUMNS, point_rows(analysis))),
        _section("dashboard", "Dashboard (one row per run)",
                 _table(DASHBOARD_COLUMNS, dashboard_rows(analysis), grey_invalid=True)),
        *([_section("spec-decode", "Speculative decoding (per run)", _table(SPEC_COLUMNS, spec))] if spec else []),
        _section("fixed", "Fixed things", "".join(f"<p>{html.escape(line)}</p>" for line in fixed_lines(analysis))),
        _section("cache", "Prefix cache", "".join(f"<p>{html.escape(line)}</p>" for line in cache_lines(analysis))),
        _section("plots", "Plots", "".join(_embedded(p) for p in plot_paths)),
        _section("per-class", "Per-class breakdown (operating point)",
                 _table(per_class_cols, _per_class_rows(analysis))),
    ]
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>Conveyor report</title>"
            f"<style>{_STYLE}</style></head><body><h1>Conveyor report</h1>{''.join(sections)}</body></html>")


def write_html(analysis: Analysis, out_dir: pathlib.Path) -> pathlib.Path:
    plot_paths = _plots(analysis, out_dir)
    path = out_dir / "report.html"
    path.write_text(render_html(analysis, plot_paths))
    return path
