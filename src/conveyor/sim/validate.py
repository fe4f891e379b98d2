"""`conveyor simulate --validate RUN_DIR... --calibration C.json`: the simulation's error on measured runs.

Each measured run is replayed as it was run: its own trace (checked against the version it recorded; each
prompt as long as the server counted it), its
offered rate, arrival process, burstiness and seed, its warm-up / cool-down window, and the engine its
server reported (`fixed.server_flags`: limits, block size, pool size). Then each metric the decision reads
is compared: signed relative error = (simulated - measured) / measured, so +20% means the simulation
promises 20% more than the server gave (a throughput) or 20% more latency. The error on runs the
calibration was not fitted on is the honest one; a run the calibration names among its fitted runs is
refused before anything is replayed.

Repeats: runs whose replays come out identical (the same trace, rate, seed and engine: the replay is
deterministic) are repeats of one measurement, and each such group is also compared as one: the simulation
against the mean of the repeats' measured values. A simulation predicts what a setting does on average;
one run of a noisy host is that average plus the host's drift, which the mean of n repeats shrinks as 1/sqrt(n).
"""

from __future__ import annotations

import csv
import json
import pathlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from conveyor.bench.jsonvalue import Fields
from conveyor.bench.measure.rundirs import RunResult, load_run
from conveyor.bench.measure.summary import RunSummary, Simulated
from conveyor.bench.measure.window import WindowConfig
from conveyor.bench.report.dashboard import format_markdown_table, format_table
from conveyor.bench.trace.traces import Trace, read_trace
from conveyor.bench.units import fmt_rate
from conveyor.sim.engine_setup import EngineSetup, setup_from_server_flags
from conveyor.sim.replay import StepPrice, calibration_entries, replay
from conveyor.sim.run_dir import SimRunSpec, write_run_dir
from conveyor.sim.workload import LoadSettings

METRICS = (("request_throughput", "req/s"), ("p50_ttft_ms", "TTFT p50"), ("p95_ttft_ms", "TTFT p95"),
           ("p50_itl_ms", "ITL p50"), ("mean_itl_ms", "ITL mean"), ("p50_e2el_ms", "E2E p50"),
           ("p95_e2el_ms", "E2E p95"), ("num_preemptions", "preemptions"))
"""(summary key, column) of each metric validated; num_preemptions is the server's counter. E2E p50 is issue
36's median-latency goal (within 5%); p95 is what the decision's objectives read. ITL mean beside p50: where
the gaps fall in two modes (one-decode steps and the rest), p50 sits on the boundary and jumps between repeats
(docs/decision.md), the mean does not."""


@dataclass(frozen=True)
class MetricError:
    """One metric of one run: measured, simulated, and the signed relative error."""

    key: str
    measured: float | None
    simulated: float | None
    relative_error: float | None
    """(simulated - measured) / measured; None when either is missing or measured is 0 and simulated is not."""


@dataclass(frozen=True)
class RunValidation:
    run_dir: str
    label: str
    request_rate: float
    errors: tuple[MetricError, ...]
    notes: tuple[str, ...] = ()
    """What the replay could not reproduce of this run (printed under the table)."""


def relative_error(measured: float | None, simulated: float | None) -> float | None:
    """Signed: positive when the simulation says more than was measured (0 when both are 0)."""
    if measured is None or simulated is None:
        return None
    if measured == 0:
        return 0.0 if simulated == 0 else None
    return (simulated - measured) / measured


def compare(measured: RunSummary, simulated: RunSummary) -> tuple[MetricError, ...]:
    out = []
    for key, _ in METRICS:
        m, s = measured.metric(key), simulated.metric(key)
        out.append(MetricError(key, m, s, relative_error(m, s)))
    return tuple(out)


def fitted_runs(calibration: pathlib.Path, hardware: str | None) -> set[pathlib.Path]:
    """The run directories the chosen calibration was fitted on, resolved from here and from the file's folder
    (`bench calibrate` stores them as given on its command line)."""
    return {base / run for c in calibration_entries(calibration, hardware) for run in c.runs
            for base in (pathlib.Path.cwd(), calibration.parent)}


def refuse_fitted(run_dirs: Sequence[pathlib.Path], fitted: set[pathlib.Path]) -> None:
    """ValueError naming the runs the calibration was fitted on: their error would flatter the model."""
    resolved = {p.resolve() for p in fitted}
    seen = [str(d) for d in run_dirs if d.resolve() in resolved]
    if seen:
        raise ValueError(f"--validate {' '.join(seen)}: fitted on by the calibration (its `runs`); validate on "
                         "runs it was not fitted on")


def spec_of(run: RunResult, simulated: Simulated) -> SimRunSpec:
    """The replay of a measured run: its trace, load shape, window and engine (module docstring)."""
    s, where = run.summary, str(run.run_dir)
    if s.simulated is not None:
        raise ValueError(f"--validate {where}: this run was simulated, not measured; validate on measured runs")
    path = find_trace(run.run_dir, pathlib.Path(s.identity.trace_path), where)
    trace = read_trace(path)
    if s.identity.trace_version and trace.header.version != s.identity.trace_version:
        raise ValueError(f"--validate {where}: {path} is not the trace it ran (version differs)")
    trace = with_counted_prompts(trace, run)
    config = _config_json(run.run_dir)
    window = Fields.of(dict(s.window), where + " window")
    sent = s.num_sent if s.num_sent is not None and s.num_sent < len(trace.requests) else None
    load = LoadSettings(request_rate=s.request_rate, arrival=s.identity.arrival, burstiness=s.identity.burstiness or 1.0,
                        time_scale=config.number("time_scale", 1.0), seed=s.identity.seed or 0, num_requests=sent,
                        profile=s.identity.profile, max_concurrency=s.identity.max_concurrency)
    flags = Fields.of(dict(s.fixed), where + " fixed").child("server_flags").data
    return SimRunSpec(f"{run.label}-simulated", str(path), trace, load,
                      setup_from_server_flags({k: str(v) for k, v in flags.items()}, where), simulated,
                      window=WindowConfig(warmup_requests=window.integer("warmup_requests"),
                                          warmup_s=window.number("warmup_s"),
                                          cooldown_requests=window.integer("cooldown_requests"),
                                          cooldown_s=window.number("cooldown_s")))


def with_counted_prompts(trace: Trace, run: RunResult) -> Trace:
    """The trace with each standalone text prompt `prompt_len` tokens long as the server counted it (requests.jsonl).

    A generated trace counts words (≈ tokens); the server's tokenizer often makes one more or one fewer.
    Replayed at the trace's count, a prompt can end a block early or late, and with a small pool that moves
    when the pool runs dry: which request is preempted, and how often. Session turns keep the trace's count
    (the server counted their history too), as do pre-tokenized prompts (already exact)."""
    if not (run.run_dir / "requests.jsonl").is_file():
        return trace
    counted = {r.request_id: r.prompt_tokens for r in run.requests() if r.prompt_tokens > 0}
    requests = [replace(r, prompt_len=counted[r.request_id])
                if r.request_id in counted and r.session_id is None and r.prompt_token_ids is None else r
                for r in trace.requests]
    return replace(trace, requests=requests)


def find_trace(run_dir: pathlib.Path, recorded: pathlib.Path, where: str) -> pathlib.Path:
    """The trace a run recorded: its path from here, else from each folder above the run directory (a
    relative path was relative to where bench run ran, often the folder holding the runs)."""
    candidates = [recorded] if recorded.is_absolute() else [recorded, *(p / recorded for p in run_dir.resolve().parents)]
    found = next((c for c in candidates if c.is_file()), None)
    if found is None:
        raise ValueError(f"--validate {where}: its trace {recorded} is not found from here or above the run")
    return found


def _config_json(run_dir: pathlib.Path) -> Fields:
    path = run_dir / "config.json"
    return Fields.of(json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None, str(path))


@dataclass(frozen=True)
class RepeatMean:
    """Repeats of one measurement (identical replays), compared as one: measured = the repeats' mean."""

    run_dirs: tuple[str, ...]
    request_rate: float
    errors: tuple[MetricError, ...]

    @property
    def label(self) -> str:
        return f"mean of {len(self.run_dirs)} repeats"


def repeat_means(results: Sequence[RunValidation]) -> list[RepeatMean]:
    """One RepeatMean per group of two or more runs whose simulated values are all equal, in first-seen order."""
    groups: dict[tuple[float, tuple[float | None, ...]], list[RunValidation]] = {}
    for result in results:
        groups.setdefault((result.request_rate, tuple(e.simulated for e in result.errors)), []).append(result)
    return [_mean_of(members) for members in groups.values() if len(members) > 1]


def _mean_of(members: Sequence[RunValidation]) -> RepeatMean:
    errors = []
    for index, (key, _) in enumerate(METRICS):
        measured = [m.errors[index].measured for m in members]
        mean = None if any(v is None for v in measured) else sum(v for v in measured if v is not None) / len(measured)
        simulated = members[0].errors[index].simulated
        errors.append(MetricError(key, mean, simulated, relative_error(mean, simulated)))
    return RepeatMean(tuple(m.run_dir for m in members), members[0].request_rate, tuple(errors))


def validate_runs(run_dirs: Sequence[pathlib.Path], step_time: StepPrice, simulated: Simulated,
                  out_dir: pathlib.Path, command: str, overrides: Callable[[EngineSetup], EngineSetup]) -> list[RunValidation]:
    """Replay each run (its simulated twin written to out_dir/runs/<name>) and compare; `overrides` applies
    the engine flags given on the command line (for what a run did not record, e.g. a vLLM server's limits)."""
    results = []
    for run_dir in run_dirs:
        run = load_run(run_dir)
        spec = spec_of(run, simulated)
        spec = replace(spec, setup=overrides(spec.setup))
        twin = write_run_dir(out_dir / "runs" / run_dir.name, spec, replay(spec, step_time), command)
        results.append(RunValidation(str(run_dir), run.label, run.offered_rate, compare(run.summary, twin),
                                     replay_notes(run)))
    return results


def replay_notes(run: RunResult) -> tuple[str, ...]:
    """What of this run the replay cannot reproduce (printed under the table)."""
    notes = []
    if run.summary.cache.mode == "warm":
        notes.append(f"{run.label}: measured with a warmed prefix cache; the replay starts cold")
    fixed = Fields.of(dict(run.summary.fixed), "fixed")
    server, flags = fixed.opt_text("server_name"), fixed.child("server_flags")
    if server not in (None, "conveyor"):
        notes.append(f"{run.label}: served by {server}, not conveyor's scheduler")
    for flag, what in (("speculative_config", "speculative decoding"), ("max_num_queued_tokens", "the prefill-token cap")):
        if flags.text(flag, "none").lower() != "none":
            notes.append(f"{run.label}: ran with {what} ({flag}), which the replay does not model")
    return tuple(notes)


def fmt_error(error: MetricError) -> str:
    if error.relative_error is not None:
        return f"{error.relative_error:+.1%}"
    return "n/a" if error.measured is None or error.simulated is None else f"{error.simulated:g} vs 0"


def table(results: Sequence[RunValidation]) -> tuple[list[str], list[list[str]]]:
    """Columns and rows: one row per run (signed errors), one per group of repeats (against their mean),
    then the mean |error| of each metric over the runs."""
    columns = ["Run", "Offered req/s", *(name for _, name in METRICS)]
    compared: list[RunValidation | RepeatMean] = [*results, *repeat_means(results)]
    rows = [[r.label, fmt_rate(r.request_rate), *(fmt_error(e) for e in r.errors)] for r in compared]
    means = []
    for index in range(len(METRICS)):
        found = [abs(e) for r in results if (e := r.errors[index].relative_error) is not None]
        means.append(f"{sum(found) / len(found):.1%}" if found else "n/a")
    rows.append(["mean |error|", "", *means])
    return columns, rows


def write_tables(out_dir: pathlib.Path, results: Sequence[RunValidation]) -> pathlib.Path:
    """validation.md (the table) and validation.csv (every metric's measured and simulated value); returns the .md."""
    out_dir.mkdir(parents=True, exist_ok=True)
    columns, rows = table(results)
    md = out_dir / "validation.md"
    md.write_text("# Simulation error on measured runs\n\nSigned relative error, (simulated - measured) / "
                  "measured.\n\n" + format_markdown_table(columns, rows) + "\n", encoding="utf-8")
    with (out_dir / "validation.csv").open("w", newline="", encoding="utf-8") as out:
        writer = csv.writer(out)
        writer.writerow(["run_dir", "label", "request_rate", "metric", "measured", "simulated", "relative_error"])
        writer.writerows([r.run_dir, r.label, r.request_rate, e.key, e.measured, e.simulated, e.relative_error]
                         for r in results for e in r.errors)
        writer.writerows([";".join(g.run_dirs), g.label, g.request_rate, e.key, e.measured, e.simulated,
                          e.relative_error] for g in repeat_means(results) for e in g.errors)
    return md


def terminal_table(results: Sequence[RunValidation]) -> str:
    return format_table(*table(results))
