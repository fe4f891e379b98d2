"""Reading benchmark run directories (RUNDIR.md) back, grouped by configuration and offered rate.

The model: a run directory is any directory holding `summary.json`. A sweep writes `sweep.json` beside
its runs and a study writes `study.json` above its sweeps; a run's configuration is the name of the
nearest enclosing directory with a `sweep.json`, else the run's own label. Runs of one configuration at
one offered rate are the repeats of one *point*. Nothing here judges a run; it only loads and groups.
"""

from __future__ import annotations

import json
import math
import pathlib
import shutil
import statistics
from dataclasses import dataclass, field
from typing import Any

SWEEP_FILE = "sweep.json"
STUDY_FILE = "study.json"
SPREAD_METRICS = ("request_throughput", "p95_ttft_ms", "p95_e2el_ms", "queue_time_p95_ms")


class RunDirError(ValueError):
    """A path that holds no run, or a malformed summary; names the path."""


def _read_jsonl(path: pathlib.Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def offered_rate_of(summary: dict[str, Any]) -> float:
    rate = summary.get("request_rate")
    return math.inf if rate in (None, "inf") else float(rate)


@dataclass(frozen=True)
class RunResult:
    """One run directory, loaded."""

    run_dir: pathlib.Path
    """Where it lives."""
    config_name: str
    """The configuration it measured."""
    summary: dict[str, Any]
    """summary.json."""
    server_info: dict[str, Any] = field(default_factory=dict)
    """server.json (models, version, config_info), or {} when absent."""

    @property
    def offered_rate(self) -> float:
        return offered_rate_of(self.summary)

    @property
    def label(self) -> str:
        return str(self.summary.get("label") or self.run_dir.name)

    @property
    def server(self) -> dict[str, Any]:
        return self.summary.get("server") or {}

    def metric(self, name: str) -> float | None:
        """A summary value by name, looking into `server` for server-side ones."""
        value = self.summary.get(name, self.server.get(name))
        return None if value is None or isinstance(value, str) else float(value)

    def requests(self) -> list[dict[str, Any]]:
        return _read_jsonl(self.run_dir / "requests.jsonl")

    def timeseries(self) -> list[dict[str, Any]]:
        return _read_jsonl(self.run_dir / "server_timeseries.jsonl")

    def config_info(self) -> dict[str, Any]:
        return dict(self.server_info.get("config_info") or {})


def _config_name(run_dir: pathlib.Path, summary: dict[str, Any]) -> str:
    for parent in run_dir.resolve().parents:
        if (parent / SWEEP_FILE).is_file():
            return parent.name
        if (parent / STUDY_FILE).is_file():
            break
    return str(summary.get("label") or run_dir.name)


def load_run(run_dir: pathlib.Path) -> RunResult:
    path = run_dir / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
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


def find_study_file(paths: list[pathlib.Path]) -> dict[str, Any]:
    """The study.json of the first path that has one ({} if none): configs' prices, SLO, main rate."""
    for path in paths:
        for candidate in (path / STUDY_FILE, path.parent / STUDY_FILE):
            if candidate.is_file():
                return dict(json.loads(candidate.read_text()))
    return {}


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
