"""Reading benchmark run directories (RUNDIR.md) back, grouped by configuration and offered rate.

The model: a run directory is any directory holding `summary.json`. A sweep writes `sweep.json` beside
its runs and a study writes `study.json` above its sweeps; a run's configuration is the name of the
nearest enclosing directory with a `sweep.json`, else the study's configuration directory it sits in, else
the run's own label. Runs of one configuration at
one offered rate are the repeats of one *point*. Nothing here judges a run; it only loads and groups.
"""

from __future__ import annotations

import gzip
import json
import pathlib
import shutil
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from conveyor.bench.jsonvalue import JSON, Fields, JsonShapeError
from conveyor.bench.measure.run_stats import RequestSample
from conveyor.bench.measure.server_summary import ServerSummary
from conveyor.bench.measure.summary import RunSummary, summary_from_json

SWEEP_FILE = "sweep.json"
STUDY_FILE = "study.json"
SPREAD_METRICS = ("request_throughput", "p95_ttft_ms", "p95_e2el_ms", "queue_time_p95_ms")


class RunDirError(ValueError):
    """A path that holds no run, or a malformed summary; names the path."""


def _read_jsonl(path: pathlib.Path) -> list[dict[str, Any]]:
    """The file's rows; `NAME.jsonl.gz` stands in for a missing `NAME.jsonl` (archived results)."""
    packed = path.with_name(path.name + ".gz")
    if path.is_file():
        text = path.read_text()
    elif packed.is_file():
        with gzip.open(packed, "rt", encoding="utf-8") as f:
            text = f.read()
    else:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@dataclass(frozen=True)
class ServerSample:
    """One scrape of the server's gauges during a run (server_timeseries.jsonl)."""

    t_s: float
    """Seconds since the load started."""
    num_requests_running: float | None
    """Running requests."""
    num_requests_waiting: float | None
    """Waiting requests."""
    kv_cache_usage_perc: float | None
    """KV cache usage, 0..1."""

    @classmethod
    def from_json(cls, f: Fields) -> ServerSample:
        return cls(f.number("t_s"), f.opt_number("num_requests_running"), f.opt_number("num_requests_waiting"),
                   f.opt_number("kv_cache_usage_perc"))


@dataclass(frozen=True)
class RunResult:
    """One run directory, loaded."""

    run_dir: pathlib.Path
    """Where it lives."""
    config_name: str
    """The configuration it measured."""
    summary: RunSummary
    """summary.json."""
    server_info: dict[str, Any] = field(default_factory=dict)
    """server.json (models, version, config_info), or {} when absent."""

    @property
    def offered_rate(self) -> float:
        return self.summary.request_rate

    @property
    def label(self) -> str:
        return self.summary.label

    @property
    def server(self) -> ServerSummary:
        return self.summary.server

    @property
    def valid(self) -> bool:
        return self.summary.valid

    def metric(self, name: str) -> float | None:
        """A summary value by name, looking into `server` for server-side ones."""
        return self.summary.metric(name)

    def requests(self) -> list[RequestSample]:
        path = self.run_dir / "requests.jsonl"
        return [RequestSample.from_json(row) for row in _read_jsonl(path)]

    def timeseries(self) -> list[ServerSample]:
        path = self.run_dir / "server_timeseries.jsonl"
        return [ServerSample.from_json(Fields.of(row, str(path))) for row in _read_jsonl(path)]

    def config_info(self) -> dict[str, str]:
        """The server's engine configuration (vLLM's cache_config_info labels), {} when not exposed."""
        return {k: str(v) for k, v in Fields.of(self.server_info, "server.json").child("config_info").data.items()}


def sweep_dir(run_dir: pathlib.Path) -> pathlib.Path | None:
    """The sweep a run belongs to: the nearest enclosing directory with a sweep.json, below any study."""
    for parent in run_dir.resolve().parents:
        if (parent / SWEEP_FILE).is_file():
            return parent
        if (parent / STUDY_FILE).is_file():
            break
    return None


def study_dir(run_dir: pathlib.Path) -> pathlib.Path | None:
    """The study a run belongs to: the nearest enclosing directory with a study.json."""
    return next((p for p in run_dir.resolve().parents if (p / STUDY_FILE).is_file()), None)


def _config_name(run_dir: pathlib.Path, summary: RunSummary) -> str:
    sweep = sweep_dir(run_dir)
    if sweep is not None:
        return sweep.name
    study = study_dir(run_dir)
    parts = run_dir.resolve().relative_to(study).parts if study is not None else ()
    # study/<config>/<run> without a sweep.json: a configuration cut short (a killed study) is still itself.
    return parts[0] if len(parts) > 1 else summary.label


def load_run(run_dir: pathlib.Path) -> RunResult:
    path = run_dir / "summary.json"
    try:
        summary = summary_from_json(json.loads(path.read_text()), run_dir.name, str(path))
    except (OSError, json.JSONDecodeError, JsonShapeError) as error:
        raise RunDirError(f"{run_dir}: cannot read summary.json ({error})") from None
    server_path = run_dir / "server.json"
    server_info = json.loads(server_path.read_text()) if server_path.is_file() else {}
    return RunResult(run_dir, _config_name(run_dir, summary), summary, server_info)


def discover_runs(paths: list[pathlib.Path]) -> list[RunResult]:
    """Every run under `paths` (each a run, sweep or study directory), in path order."""
    runs: list[RunResult] = []
    seen: set[pathlib.Path] = set()
    for path in paths:
        if not path.is_dir():
            raise RunDirError(f"{path}: not a directory")
        found = sorted({p.parent.resolve() for p in path.rglob("summary.json")})
        if not found:
            raise RunDirError(f"{path}: no run directory (summary.json) inside")
        runs.extend(load_run(d) for d in found if d not in seen)  # a run named twice counts once
        seen.update(found)
    return runs


@dataclass(frozen=True)
class Spread:
    """One metric over the repeats of a point."""

    median: float
    """Median over repeats."""
    low: float
    """Smallest repeat."""
    high: float
    """Largest repeat."""

    @property
    def relative(self) -> float:
        """(high − low) / median: 0 when every repeat agrees."""
        return 0.0 if self.median == 0 else (self.high - self.low) / abs(self.median)


@dataclass(frozen=True)
class Point:
    """The repeats of one configuration at one offered rate."""

    config_name: str
    """Configuration."""
    offered_rate: float
    """req/s offered (inf: all at once)."""
    runs: tuple[RunResult, ...]
    """Its repeats."""

    def spread(self, metric: str) -> Spread | None:
        values = [v for v in (r.metric(metric) for r in self.runs) if v is not None]
        if not values:
            return None
        return Spread(statistics.median(values), min(values), max(values))

    def median(self, metric: str) -> float | None:
        spread = self.spread(metric)
        return None if spread is None else spread.median


def group_points(runs: list[RunResult]) -> dict[str, list[Point]]:
    """config name -> its points in increasing offered rate (configs in first-seen order)."""
    grouped: dict[str, dict[float, list[RunResult]]] = {}
    for run in runs:
        grouped.setdefault(run.config_name, {}).setdefault(run.offered_rate, []).append(run)
    return {
        name: [Point(name, rate, tuple(by_rate[rate])) for rate in sorted(by_rate)]
        for name, by_rate in grouped.items()
    }


@dataclass(frozen=True)
class StudyConfig:
    """One configuration of a study, as study.json records it."""

    changed: str | None = None
    """The one parameter it changes from the baseline (None: the baseline)."""
    price_per_gpu_hour: float | None = None
    """Its price (None: the report's default)."""
    num_gpus: int | None = None
    """GPUs it occupies (None: the report's default)."""
    varies: tuple[str, ...] = ()
    """Fixed things it changes on purpose (e.g. the trace): not a mixed comparison."""
    value: str | None = None
    """The changed parameter's value in its engine flags (e.g. `fp8` for kv_cache_dtype)."""
    launch_error: str | None = None
    """Why its server did not start (None: it started); such a configuration has no runs."""

    @classmethod
    def from_json(cls, f: Fields) -> StudyConfig:
        changed = f.opt_text("changed")
        value = f.child("args").opt_text(changed) if changed is not None else None
        return cls(changed, f.opt_number("price_per_gpu_hour"), f.opt_integer("num_gpus"), f.text_list("varies"),
                   value, f.opt_text("launch_error"))

    @property
    def change(self) -> str:
        """What it changes, as the report shows it: `kv_cache_dtype=fp8`, or `-` for the baseline."""
        if self.changed is None:
            return "-"
        return self.changed if self.value is None else f"{self.changed}={self.value}"


@dataclass(frozen=True)
class StudyFile:
    """study.json read back: the objective, the main rate and the configurations in study order."""

    slo: Mapping[str, float | None] = field(default_factory=dict)
    """The objective's bounds by SLO field name (checked by decide/slo.py)."""
    main_rate: float | None = None
    """Offered rate of the main traffic scenario."""
    planned_context_len: int | None = None
    """The context length the deployment plans for."""
    configs: Mapping[str, StudyConfig] = field(default_factory=dict)
    """Configuration name -> its record, in study order (the baseline first)."""

    @classmethod
    def from_json(cls, data: JSON, where: str) -> StudyFile:
        f = Fields.of(data, where)
        return cls(f.child("slo").numbers(), f.opt_number("main_rate"), f.opt_integer("planned_context_len"),
                   {name: StudyConfig.from_json(c) for name, c in f.child("configs").children().items()})


def read_study_file(path: pathlib.Path) -> StudyFile:
    """One study.json; RunDirError (naming it) when malformed."""
    try:
        return StudyFile.from_json(json.loads(path.read_text()), str(path))
    except (json.JSONDecodeError, JsonShapeError) as error:
        raise RunDirError(f"{path}: {error}") from None


def find_study_file(paths: list[pathlib.Path]) -> StudyFile:
    """The study.json of the first path that has one (empty if none): configs' prices, SLO, main rate."""
    for path in paths:
        for candidate in (path / STUDY_FILE, path.parent / STUDY_FILE):
            if candidate.is_file():
                return read_study_file(candidate)
    return StudyFile()


def prepare_out_dir(path: pathlib.Path, force: bool) -> None:
    """Refuse to write over an existing run, sweep or study unless `force`; with force, clear it first
    (stale runs left in it would be read back as part of the new one)."""
    if not path.exists():
        return
    markers = ("summary.json", SWEEP_FILE, STUDY_FILE)
    holds_runs = path.is_dir() and any(next(path.rglob(m), None) is not None for m in markers)
    if not holds_runs:
        return
    if not force:
        raise RunDirError(f"--out {path} already holds a run; choose another directory or pass --force to replace it")
    shutil.rmtree(path)
