"""From run directories to the guide's dashboard, the recommendation, the checklist and the diagnosis.

The model: `analyze` loads every run under the given paths (run, sweep or study directories), checks
that their fixed things agree (fixed.py; a difference is refused unless `allow_mixed`, except what a
study varies on purpose), groups them by configuration and offered rate, judges every point on its
valid repeats against the objective (from the flags, else the study's study.json), prices them, and
collects the findings. The same `Analysis` is rendered as a terminal table, Markdown, CSV, and
(report_html.py, written by write.py) a self-contained HTML page with plots. Invalid runs are listed, marked INVALID, and
counted nowhere.
"""

from __future__ import annotations

import csv
import io
import pathlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from conveyor.bench.decide.decision import (
    ConfigEval,
    CostModel,
    DecisionInputs,
    Recommendation,
    cost_text,
    evaluate_configs,
)
from conveyor.bench.decide.decision_checklist import ChecklistInputs, ChecklistItem
from conveyor.bench.decide.diagnose import Finding, diagnose
from conveyor.bench.decide.gpu_prices import GpuPrice, gpu_costs, match_prices
from conveyor.bench.decide.headline import decide
from conveyor.bench.decide.point_verdict import PointStatus
from conveyor.bench.decide.slo import SLO, SLOVerdict, describe_objective, slo_from_mapping
from conveyor.bench.measure.fixed import FixedDifference, FixedRecord, differences, kv_cache_dtype, unknown_keys
from conveyor.bench.measure.gpu_groups import PER_MACHINE, GpuConfigs, config_studies, key_runs, within_gpu_differences
from conveyor.bench.measure.intervals import IntervalConfig
from conveyor.bench.measure.cache_summary import cache_report_lines, hit_rate_cell
from conveyor.bench.measure.rundirs import Point, RunResult, StudyFile, discover_runs, find_study_file, group_points
from conveyor.bench.report.gpu_report import GPU_COLUMNS, gpu_lines, gpu_rows, shows_gpus
from conveyor.bench.report.report_format import fmt_interval, summary_cell
from conveyor.bench.units import fmt_bytes, fmt_count, fmt_percent, fmt_rate

DASHBOARD_COLUMNS = ("Config", "Run", "Offered req/s", "Completed req/s", "TTFT p95", "Queue p95",
                     "E2E p95", "Error rate", "Preemptions", "Peak memory", "Prefix-cache hits", "Objective")
POINT_COLUMNS = ("Config", "Offered req/s", "Valid repeats", "Completed req/s", "TTFT p95", "E2E p95",
                 "Error rate", "Verdict")


class MixedRunsError(ValueError):
    """Runs whose fixed things differ were given together without --allow-mixed."""


@dataclass(frozen=True)
class ReportInputs:
    """What to analyse and against which objective and prices."""

    paths: tuple[pathlib.Path, ...]
    """Run, sweep or study directories."""
    slo: SLO | None = None
    """Objective (None: the study's, else none)."""
    default_cost: CostModel = field(default_factory=CostModel)
    """Price of configurations the study does not price (none by default: no price is built in)."""
    main_rate: float | None = None
    """Main-scenario rate (None: the study's, else the lowest measured)."""
    allow_mixed: bool = False
    """Compare runs whose fixed things differ (the report then says how)."""
    gpu_prices: Mapping[str, float] = field(default_factory=dict)
    """USD per GPU-hour by GPU name as the user wrote it (`--price H100=2.99`), matched to fixed.gpu_name."""


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
    """Diagnosis (on valid runs only)."""
    study: StudyFile
    """study.json (empty for loose runs)."""
    main_rate: float | None
    """Main-scenario rate used."""
    fixed_differences: list[FixedDifference] = field(default_factory=list)
    """Fixed things that differ (only with allow_mixed)."""
    fixed_unknown: list[str] = field(default_factory=list)
    """Fixed things some run did not record."""
    headline: str = ""
    """The recommendation in one line: configuration, capacity, cost, confidence (decide/headline.py)."""
    gpus: GpuConfigs = field(default_factory=GpuConfigs)
    """Each configuration's (GPU, name) (measure/gpu_groups.py)."""
    gpu_prices: Mapping[str, GpuPrice] = field(default_factory=dict)
    """gpu_name -> the price the user gave for it."""

    def runs(self) -> list[RunResult]:
        return [r for pts in self.points.values() for p in pts for r in p.runs]


def _costs(study: StudyFile, default: CostModel) -> dict[str, CostModel]:
    """Each configuration's price: its own in study.json, else the default (a flag, or none), saying which."""
    out = {}
    for name, c in study.configs.items():
        gpus = default.num_gpus if c.num_gpus is None else c.num_gpus
        if c.price_per_gpu_hour is None:
            out[name] = CostModel(default.price_per_gpu_hour, gpus, default.price_source)
        else:
            out[name] = CostModel(c.price_per_gpu_hour, gpus, "study.json")
    return out


def check_fixed(runs: list[RunResult], study: StudyFile,
                allow_mixed: bool) -> tuple[list[FixedDifference], list[str]]:
    """Fixed things that differ, and those unknown; raises MixedRunsError on a difference unless allowed."""
    records = [FixedRecord(r.label, r.config_name, dict(r.summary.fixed)) for r in runs]
    varied = {name: set(c.varies) for name, c in study.configs.items()}
    found = differences(records, varied)
    found += [d for d in within_gpu_differences(records) if all(f.key != d.key for f in found)]
    if found and not allow_mixed:
        raise MixedRunsError("these runs differ in what must stay fixed between compared runs: "
                             + "; ".join(d.describe() for d in found)
                             + ". Compare like with like, or pass --allow-mixed to compare them anyway.")
    return found, unknown_keys(records)


def analyze(inputs: ReportInputs) -> Analysis:
    base = find_study_file(list(inputs.paths))
    slo = inputs.slo or slo_from_mapping({k: v for k, v in base.slo.items() if v is not None}, "study.json [slo]")
    main_rate = inputs.main_rate if inputs.main_rate is not None else base.main_rate
    gpus = key_runs(discover_runs(list(inputs.paths)), inputs.allow_mixed)
    study = config_studies(gpus, base, inputs.slo is not None)
    prices = match_prices(inputs.gpu_prices, gpus.gpu_names)
    mixed, unknown = check_fixed(list(gpus.runs), study, inputs.allow_mixed)
    points = group_points(list(gpus.runs))
    order = list(study.configs)
    points = dict(sorted(points.items(), key=lambda kv: (order.index(kv[0]) if kv[0] in order else len(order))))
    costs = gpu_costs(gpus, prices, _costs(study, inputs.default_cost), inputs.default_cost)
    decision = DecisionInputs(slo=slo, default_cost=inputs.default_cost, costs=costs, main_rate=main_rate)
    configs = evaluate_configs(points, decision)
    decided = decide(configs, ChecklistInputs(main_rate, study.planned_context_len, mixed, unknown))
    return Analysis(slo, points, configs, decided.recommendation, list(decided.checklist), diagnose(points), study,
                    main_rate, mixed, unknown, decided.headline, gpus, prices)


def objective_cell(run: RunResult, verdict: SLOVerdict) -> str:
    if not run.valid:
        reason = (run.summary.validity.invalid_reason or "client fell behind").split(":")[0]
        return f"INVALID ({reason})"
    return {"met": "met", "missed": "MISSED"}.get(verdict.status.value, verdict.status.value)


def run_cell(run: RunResult) -> str:
    """The run's name; a simulated one says so on every row, so a what-if is never read as a measurement."""
    return f"{run.label} (simulated)" if run.summary.simulated is not None else run.label


def simulated_lines(analysis: Analysis) -> list[str]:
    """One line per simulated run: what priced its steps (and the GPU it was scaled to)."""
    lines = []
    for run in analysis.runs():
        sim = run.summary.simulated
        if sim is not None:
            target = f"; scaled to {sim.target_gpu} (cross-hardware)" if sim.target_gpu else ""
            source = f" from {sim.calibration}" if sim.calibration else ""
            lines.append(f"Simulated, not measured: {run.label} (step time {sim.step_time}{source}{target}).")
    return lines


def dashboard_rows(analysis: Analysis) -> list[list[str]]:
    """One row per run: the guide's dashboard (RUNDIR.md mapping), with intervals, and its own verdict."""
    rows = []
    for config in analysis.configs:
        for evaluated in config.points:
            for run, verdict in zip(evaluated.point.runs, evaluated.verdicts, strict=True):
                s = run.summary
                rows.append([
                    config.name, run_cell(run), fmt_rate(run.offered_rate), summary_cell(s, "request_throughput"),
                    summary_cell(s, "p95_ttft_ms"), summary_cell(s, "server.queue_time_p95_ms"),
                    summary_cell(s, "p95_e2el_ms"), summary_cell(s, "error_rate"),
                    fmt_count(run.metric("num_preemptions")), fmt_bytes(run.metric("peak_gpu_memory_bytes")),
                    hit_rate_cell(s.cache), objective_cell(run, verdict),
                ])
    return rows


def point_rows(analysis: Analysis) -> list[list[str]]:
    """One row per point: the valid repeats pooled, with intervals, and the point's verdict."""
    rows = []
    for config in analysis.configs:
        for p in config.points:
            pooled = p.intervals
            cells = [fmt_interval(iv.estimate if iv else None, iv, unit) for iv, unit in (
                (pooled.get("request_throughput"), "rate"), (pooled.get("p95_ttft_ms"), "ms"),
                (pooled.get("p95_e2el_ms"), "ms"), (pooled.get("error_rate"), "percent"))]
            invalid = f" (+{len(p.invalid_runs)} invalid)" if p.invalid_runs else ""
            status = p.status.value.upper() if p.status is PointStatus.MISSED else p.status.value
            rows.append([config.name, fmt_rate(p.offered_rate), f"{len(p.valid_runs)}{invalid}", *cells, status])
    return rows


def config_rows(analysis: Analysis) -> list[list[str]]:
    """One row per configuration: what it changed, capacity, cost, whether recommended."""
    configs = analysis.study.configs
    rows = []
    for config in analysis.configs:
        changed = configs[config.name].change if config.name in configs else "-"
        mark = ""
        if config.name == analysis.recommendation.recommended:
            mark = "recommended"
        elif config.name in analysis.recommendation.tied:
            mark = "tied"
        rows.append([config.name, str(changed), fmt_rate(config.max_rate_meeting), config.capacity.describe(),
                     cost_text(config), mark])
    return rows


CONFIG_COLUMNS = ("Config", "Changes", "Max req/s meeting objective", "Capacity (req/s)",
                  "Cost per accepted response", "")
SPEC_COLUMNS = ("Config", "Run", "Output tok/s", "Draft acceptance", "Mean accepted length", "Draft tokens")


def spec_rows(analysis: Analysis) -> list[list[str]]:
    """Speculative decoding, one row per run that verified drafts (none: the section is left out).
    Mean accepted length counts the target's own token (1.0: speculation emitted nothing extra)."""
    rows = []
    for config in analysis.configs:
        for evaluated in config.points:
            for run in evaluated.point.runs:
                drafted = run.metric("spec_decode_num_draft_tokens")
                if not drafted:
                    continue
                length = run.metric("spec_decode_mean_accepted_length")
                rows.append([config.name, run.label, fmt_rate(run.metric("output_throughput")),
                             fmt_percent(run.metric("spec_decode_acceptance_rate")),
                             "-" if length is None else f"{length:.2f}", fmt_count(drafted)])
    return rows


def _spec_section(analysis: Analysis, table: Callable[[tuple[str, ...], list[list[str]]], str]) -> list[str]:
    rows = spec_rows(analysis)
    return ["Speculative decoding (per run):", table(SPEC_COLUMNS, rows), ""] if rows else []


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


def fixed_lines(analysis: Analysis) -> list[str]:
    if analysis.fixed_differences:
        return ["WARNING (--allow-mixed): the runs differ in what should stay fixed: "
                + "; ".join(d.describe() for d in analysis.fixed_differences)]
    runs = analysis.runs()
    fixed = dict(runs[0].summary.fixed) if runs else {}
    # across GPUs the GPU's name and the host's count are each configuration's: the per-GPU lines show them
    per_config = {"server_flags", *PER_MACHINE} if analysis.gpus.by_gpu else {"server_flags"}
    shown = ", ".join(f"{k}={str(v)[:12] if k.endswith('sha256') else v}" for k, v in fixed.items()
                      if k not in per_config and v is not None)
    unknown = f"; unknown: {', '.join(analysis.fixed_unknown)}" if analysis.fixed_unknown else ""
    return [f"Fixed across all runs: {shown or 'nothing recorded'}{unknown}"]


def kv_cache_dtype_lines(analysis: Analysis) -> list[str]:
    """Each configuration's KV cache element type from its servers' flags, when configurations differ in
    it (a study of --kv-cache-dtype: bf16 against fp8 holds twice the blocks, which is the point)."""
    dtypes: dict[str, str] = {}
    for name, points in analysis.points.items():
        found = [d for p in points for r in p.runs if (d := kv_cache_dtype(dict(r.summary.fixed))) is not None]
        if found:
            dtypes[name] = ", ".join(dict.fromkeys(found))
    if len(set(dtypes.values())) < 2:
        return []
    return ["KV cache dtype per configuration: " + ", ".join(f"{name}={d}" for name, d in dtypes.items())]


def cache_lines(analysis: Analysis) -> list[str]:
    return cache_report_lines([(run.label, run.summary.cache) for run in analysis.runs()])


def launch_lines(analysis: Analysis) -> list[str]:
    """Configurations whose server never started: an answer too (e.g. no GPU memory left for the KV cache)."""
    return [f"Did not start: {name}: {c.launch_error}" for name, c in analysis.study.configs.items()
            if c.launch_error]


def decision_lines(analysis: Analysis) -> list[str]:
    """Objective, recommendation and its confidence, checklist and diagnosis as plain lines."""
    rec = analysis.recommendation
    lines = [f"Objective: {describe_objective(analysis.slo)}",
             f"Intervals: {IntervalConfig().confidence:.0%} confidence (bootstrap over requests and repeats).",
             *fixed_lines(analysis), *kv_cache_dtype_lines(analysis), *simulated_lines(analysis),
             *cache_lines(analysis), *launch_lines(analysis),
             f"Recommendation: {analysis.headline}", "Because:", *(f"- {r}" for r in rec.reasons),
             f"Confidence: {rec.confidence}", "", "Checklist:"]
    lines.extend(f"- [{i.answer.value}] {i.question} {i.evidence}" for i in analysis.checklist)
    lines.extend(["", "Diagnosis (valid runs only):"])
    if not analysis.findings:
        lines.append("- no symptom of the guide's five found")
    lines.extend(f"- {f.symptom.value} ({f.config_name}): {f.evidence}. Look at: {f.remedy}"
                 for f in analysis.findings)
    return lines


def _gpu_section(analysis: Analysis, table: Callable[[tuple[str, ...], list[list[str]]], str],
                 title: str = "Per GPU (valid runs):", bullet: str = "") -> list[str]:
    if not shows_gpus(analysis.gpus, analysis.gpu_prices):
        return []
    return [title, *(bullet + line for line in gpu_lines(analysis.gpus, analysis.gpu_prices)), "",
            table(GPU_COLUMNS, gpu_rows(analysis.configs, analysis.gpus)), ""]


def format_terminal(analysis: Analysis) -> str:
    return "\n".join([format_table(DASHBOARD_COLUMNS, dashboard_rows(analysis)), "",
                      *_spec_section(analysis, format_table), *_gpu_section(analysis, format_table),
                      format_table(POINT_COLUMNS, point_rows(analysis)), "",
                      format_table(CONFIG_COLUMNS, config_rows(analysis)), "", *decision_lines(analysis)])


def format_markdown(analysis: Analysis) -> str:
    rec = analysis.recommendation
    return "\n".join(["# Conveyor report", "", "## Recommendation", "", f"**{analysis.headline}**", "",
                      *(f"- {r}" for r in rec.reasons), "", f"Confidence: {rec.confidence}", "",
                      "## Configurations", "",
                      format_markdown_table(CONFIG_COLUMNS, config_rows(analysis)), "", "## Points", "",
                      format_markdown_table(POINT_COLUMNS, point_rows(analysis)), "", "## Dashboard", "",
                      format_markdown_table(DASHBOARD_COLUMNS, dashboard_rows(analysis)), "",
                      *_spec_section(analysis, format_markdown_table), *_gpu_section(analysis, format_markdown_table, "## Per GPU (valid runs)\n", "- "),
                      "## Decision details", "", *decision_lines(analysis), ""])
