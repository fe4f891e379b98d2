"""From run directories to the guide's dashboard, the recommendation, the checklist and the diagnosis.

The model: `analyze` loads every run under the given paths (run, sweep or study directories), groups
them by configuration and offered rate, judges them against the objective (from the flags, else the
study's study.json), prices them, and collects the findings. The same `Analysis` is rendered as a
terminal table, Markdown, CSV, and (report_html.py) an HTML page with plots.
"""

from __future__ import annotations

import csv
import io
import math
import pathlib
from dataclasses import dataclass
from typing import Any

from conveyor.bench.decision import (
    ConfigEval,
    CostModel,
    DecisionInputs,
    Recommendation,
    evaluate_configs,
    recommend,
)
from conveyor.bench.decision_checklist import ChecklistItem, answer_checklist
from conveyor.bench.diagnose import Finding, diagnose
from conveyor.bench.rundirs import Point, RunResult, discover_runs, find_study_file, group_points
from conveyor.bench.slo import SLO, slo_from_mapping

DASHBOARD_COLUMNS = ("Config", "Run", "Offered req/s", "Completed req/s", "TTFT p95 ms", "Queue p95 ms",
                     "E2E p95 ms", "Error rate", "Preemptions", "Objective")


@dataclass(frozen=True)
class ReportInputs:
    """What to analyse and against which objective and prices."""

    paths: tuple[pathlib.Path, ...]
    """Run, sweep or study directories."""
    slo: SLO | None = None
    """Objective (None: the study's, else none)."""
    default_cost: CostModel = CostModel()
    """Price of configurations the study does not price."""
    main_rate: float | None = None
    """Main-scenario rate (None: the study's, else the lowest measured)."""


@dataclass(frozen=True)
class Analysis:
    """Everything the report shows."""

    slo: SLO
    """The objective applied."""
    points: dict[str, list[Point]]
    """config -> points by rate."""
    configs: list[ConfigEval]
    """Judged configurations."""
    recommendation: Recommendation
    """The answer."""
    checklist: list[ChecklistItem]
    """The guide's five questions."""
    findings: list[Finding]
    """Diagnosis."""
    study: dict[str, Any]
    """study.json ({} for loose runs)."""
    main_rate: float | None
    """Main-scenario rate used."""

    def runs(self) -> list[RunResult]:
        return [r for pts in self.points.values() for p in pts for r in p.runs]


def _costs(study: dict[str, Any], default: CostModel) -> dict[str, CostModel]:
    return {name: CostModel(float(c.get("price_per_gpu_hour", default.price_per_gpu_hour)),
                            int(c.get("num_gpus", default.num_gpus)))
            for name, c in (study.get("configs") or {}).items()}


def analyze(inputs: ReportInputs) -> Analysis:
    study = find_study_file(list(inputs.paths))
    slo = inputs.slo or slo_from_mapping(dict(study.get("slo") or {}), "study.json [slo]")
    main_rate = inputs.main_rate if inputs.main_rate is not None else study.get("main_rate")
    points = group_points(discover_runs(list(inputs.paths)))
    order = list(study.get("configs") or {})
    points = dict(sorted(points.items(), key=lambda kv: (order.index(kv[0]) if kv[0] in order else len(order))))
    decision = DecisionInputs(slo=slo, default_cost=inputs.default_cost,
                              costs=_costs(study, inputs.default_cost), main_rate=main_rate)
    configs = evaluate_configs(points, decision)
    recommendation = recommend(configs, decision.tie_tolerance)
    return Analysis(slo, points, configs, recommendation, answer_checklist(configs, recommendation, main_rate),
                    diagnose(points), study, main_rate)


def _fmt(value: float | None, digits: int = 4) -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return "inf"
    return f"{value:.{digits}g}"


def dashboard_rows(analysis: Analysis) -> list[list[str]]:
    """One row per run: the guide's dashboard (RUNDIR.md mapping) plus configuration and verdict."""
    rows = []
    for config in analysis.configs:
        for evaluated in config.points:
            for run, verdict in zip(evaluated.point.runs, evaluated.verdicts, strict=True):
                error_rate = run.metric("error_rate")
                rows.append([
                    config.name, run.label, _fmt(run.offered_rate), _fmt(run.metric("request_throughput")),
                    _fmt(run.metric("p95_ttft_ms")), _fmt(run.metric("queue_time_p95_ms")),
                    _fmt(run.metric("p95_e2el_ms")), "-" if error_rate is None else f"{error_rate:.1%}",
                    _fmt(run.metric("num_preemptions")), _objective_cell(run, verdict.passed),
                ])
    return rows


def _objective_cell(run: RunResult, passed: bool) -> str:
    if run.summary.get("valid") is False:
        reason = str(run.summary.get("invalid_reason") or "client fell behind").split(":")[0]
        return f"INVALID ({reason})"
    return "met" if passed else "MISSED"


def config_rows(analysis: Analysis) -> list[list[str]]:
    """One row per configuration: what it changed, highest rate meeting the objective, cost."""
    configs = analysis.study.get("configs") or {}
    rows = []
    for config in analysis.configs:
        cost = config.cost_per_accepted
        changed = (configs.get(config.name) or {}).get("changed") or "-"
        rows.append([config.name, str(changed), _fmt(config.max_rate_meeting),
                     "-" if cost is None else f"${cost:.3g}", _spread_cell(config),
                     "recommended" if config.name == analysis.recommendation.recommended else ""])
    return rows


def _spread_cell(config: ConfigEval) -> str:
    """Range over repeats at the operating point (else the first point): n repeats, p95 E2E and req/s."""
    evaluated = config.operating_point or (config.points[0] if config.points else None)
    if evaluated is None or len(evaluated.point.runs) < 2:
        return "1 run"
    parts = [f"{len(evaluated.point.runs)} runs"]
    for metric, name in (("p95_e2el_ms", "E2E"), ("request_throughput", "req/s")):
        spread = evaluated.point.spread(metric)
        if spread is not None:
            parts.append(f"{name} ±{spread.relative / 2:.0%}")
    return ", ".join(parts)


CONFIG_COLUMNS = ("Config", "Changes", "Max req/s meeting objective", "Cost per accepted response",
                  "Spread over repeats", "")


def format_table(columns: tuple[str, ...] | list[str], rows: list[list[str]]) -> str:
    """Aligned plain-text table for the terminal."""
    widths = [max(len(str(c)), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(columns)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines.extend("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in rows)
    return "\n".join(lines)


def format_markdown_table(columns: tuple[str, ...] | list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines.extend("| " + " | ".join(r) + " |" for r in rows)
    return "\n".join(lines)


def format_csv(analysis: Analysis) -> str:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(DASHBOARD_COLUMNS)
    writer.writerows(dashboard_rows(analysis))
    return out.getvalue()


def decision_lines(analysis: Analysis) -> list[str]:
    """Recommendation, checklist and diagnosis as plain lines (terminal and Markdown share them)."""
    objective = (str(analysis.slo.to_dict()) if not analysis.slo.is_empty() else
                 "none set (give --slo): every run meets it and the choice rests on cost alone")
    lines = [f"Objective: {objective}",
             f"Recommendation ({analysis.recommendation.outcome.value}): {analysis.recommendation.explanation}",
             "", "Checklist:"]
    lines.extend(f"- [{i.answer.value}] {i.question} {i.evidence}" for i in analysis.checklist)
    lines.extend(["", "Diagnosis:"])
    if not analysis.findings:
        lines.append("- no symptom of the guide's five found")
    lines.extend(f"- {f.symptom.value} ({f.config_name}): {f.evidence}. Look at: {f.remedy}"
                 for f in analysis.findings)
    return lines


def format_terminal(analysis: Analysis) -> str:
    return "\n".join([format_table(DASHBOARD_COLUMNS, dashboard_rows(analysis)), "",
                      format_table(CONFIG_COLUMNS, config_rows(analysis)), "", *decision_lines(analysis)])


def format_markdown(analysis: Analysis) -> str:
    return "\n".join(["# Conveyor report", "", "## Recommendation", "",
                      analysis.recommendation.explanation, "", "## Configurations", "",
                      format_markdown_table(CONFIG_COLUMNS, config_rows(analysis)), "", "## Dashboard", "",
                      format_markdown_table(DASHBOARD_COLUMNS, dashboard_rows(analysis)), "",
                      "## Decision details", "", *decision_lines(analysis), ""])


def write_report(analysis: Analysis, out_dir: pathlib.Path) -> dict[str, pathlib.Path]:
    """report.md, dashboard.csv, report.html and plots/*.png under `out_dir`."""
    from conveyor.bench.report_html import write_html  # matplotlib is loaded only when writing plots

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out_dir / "report.md", "csv": out_dir / "dashboard.csv"}
    paths["markdown"].write_text(format_markdown(analysis))
    paths["csv"].write_text(format_csv(analysis))
    paths["html"] = write_html(analysis, out_dir)
    return paths
