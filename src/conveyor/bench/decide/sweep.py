"""Rate sweep of one server: find the highest offered rate that meets the objective, and how sure we are.

The model: offered rates rise geometrically from `start_rate` (chosen below the expected load) by
`growth_factor` until a point is not met; if the very first point is missed, rates fall by the same
factor until one is met. The boundary between the last met and the first not-met rate is then bisected
`bisect_steps` times at the geometric midpoint. Each point is judged on its valid repeats pooled
(point_verdict.py: met / missed / undecided). A point runs `num_repeats` repeats, then more, one at a
time (arrival seed `seed + k`), while it is undecided and neither `max_repeats` nor `max_duration_s` (run
seconds spent on the point) is spent; it ends undecided if the budget runs out. A repeat after one whose rate
was not shown sustained sends `lengthen_factor` times as many requests (lengthen.py). An invalid run (the
client fell behind, saturated its CPU, or hit client-side errors) is moved aside as
`rate-<r>-rep<k>-invalid<i>` and run again, up to `max_invalid_reruns` times: it counts neither way; a
point with no valid repeat is invalid and stops the upward search (the client cannot measure there).
A repeat showing *runaway overload* (error rate above `runaway_error_rate`; half the requests waiting at
once; or completed req/s below `runaway_completion_ratio` × offered over a dispatch window long against
the median latency) makes its point missed at once: further repeats and higher rates are skipped, since
they would only pile up a queue that never drains. The same search runs over a closed loop's concurrency
instead of the rate (sweep_axis.py: how the values step there). The run function is injected, so the search is tested
without a server (run_fn.py wires it to `conveyor.bench.measure.runner.run_benchmark`).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from conveyor.bench.decide.lengthen import Lengthening, next_length, requests_sent
from conveyor.bench.decide.point_verdict import PointStatus, point_verdict
from conveyor.bench.decide.run_fn import RunFn
from conveyor.bench.decide.slo import SLO
from conveyor.bench.decide.sweep_axis import SweepAxis, axis_unit, first_value, midpoint, next_value, run_dir_name
from conveyor.bench.jsonvalue import Fields
from conveyor.bench.measure.intervals import IntervalConfig
from conveyor.bench.measure.rundirs import SPREAD_METRICS, SWEEP_FILE, RunResult
from conveyor.bench.measure.summary import RunSummary

_MIN_PROMPTS_FOR_QUEUE_RULE = 20
"""Below this many requests a queue holding half of them is a burst, not a backlog."""


class SweepError(ValueError):
    """A sweep setting that cannot work; names the flag."""


@dataclass(frozen=True)
class SweepConfig:
    """How the rate search proceeds."""

    slo: SLO
    """The objective every point is checked against."""
    start_rate: float = 1.0
    """First offered rate, req/s (pick it below the expected load)."""
    growth_factor: float = 2.0
    """Ratio between successive rates while searching for the boundary."""
    max_rate: float | None = None
    """Never offer more than this (None: no cap)."""
    max_points: int = 8
    """Most distinct rates before bisection."""
    bisect_steps: int = 2
    """Bisections of the boundary once it is bracketed."""
    num_repeats: int = 2
    """Repeats every point runs (the spread over them is reported)."""
    max_repeats: int = 5
    """Most repeats of an undecided point."""
    max_duration_s: float | None = None
    """Most run seconds spent on one point, all its repeats together (None: no limit)."""
    max_invalid_reruns: int = 2
    """Times an invalid run is run again before its repeat is given up."""
    runaway_error_rate: float = 0.5
    """Error rate that stops the sweep at once."""
    runaway_completion_ratio: float = 0.5
    """Completed req/s below this fraction of the offered rate stops the sweep at once."""
    axis: SweepAxis = SweepAxis.RATE
    """rate, or concurrency (then start_rate / max_rate are concurrency levels)."""
    lengthen_factor: float = 2.0
    """A repeat after one whose rate was not shown sustained sends this many times its requests (1: never)."""
    max_requests: int | None = None
    """Never lengthen a run past this many requests (None: up to the trace's length)."""

    def __post_init__(self) -> None:
        if self.start_rate <= 0:
            raise SweepError(f"--start-rate must be > 0 (got {self.start_rate})")
        if self.growth_factor <= 1:
            raise SweepError(f"--growth-factor must be > 1 (got {self.growth_factor})")
        if self.num_repeats < 1 or self.max_points < 1 or self.bisect_steps < 0:
            raise SweepError("--repeats and --max-points must be >= 1, --bisect-steps >= 0")
        if self.max_repeats < self.num_repeats:
            raise SweepError(f"--max-repeats ({self.max_repeats}) must be >= --repeats ({self.num_repeats})")
        if self.max_invalid_reruns < 0 or (self.max_duration_s is not None and self.max_duration_s <= 0):
            raise SweepError("--max-invalid-reruns must be >= 0 and --max-duration > 0")
        if not self.lengthen_factor >= 1:
            raise SweepError(f"--lengthen-factor must be >= 1 (got {self.lengthen_factor}; 1 never lengthens)")
        if self.max_requests is not None and self.max_requests < 1:
            raise SweepError(f"--max-requests must be >= 1 (got {self.max_requests})")


@dataclass(frozen=True)
class SweepPoint:
    """One offered rate and what its repeats showed."""

    rate: float
    """Offered req/s."""
    status: str
    """met / missed / undecided / no_data / invalid (PointStatus) over the valid repeats pooled."""
    runaway: bool
    """A repeat showed runaway overload (remaining repeats skipped)."""
    run_dirs: list[str]
    """Valid run directories, relative to the sweep directory."""
    failures: list[str]
    """Bounds not met (with their intervals), or the runaway reason."""
    spread: dict[str, dict[str, float]] = field(default_factory=dict)
    """metric -> {median, low, high} over valid repeats."""
    invalid_dirs: list[str] = field(default_factory=list)
    """Invalid runs moved aside (shown greyed in the report, never counted)."""
    num_requests: list[int] = field(default_factory=list)
    """Requests each valid repeat sent, in run_dirs' order (a lengthened repeat sends more)."""

    @property
    def passed(self) -> bool:
        return self.status == PointStatus.MET.value


@dataclass(frozen=True)
class SweepResult:
    """The whole search."""

    config: str
    """Configuration (server) name."""
    slo: dict[str, float]
    """The objective."""
    points: list[SweepPoint]
    """In the order they were run."""
    fixed: dict[str, list[str]]
    """trace path and version, model, server version seen across runs (one value each when clean)."""

    @property
    def max_rate_meeting(self) -> float | None:
        """Highest met rate below the lowest missed one (undecided and invalid points count neither way)."""
        missed = [p.rate for p in self.points if p.status == PointStatus.MISSED.value]
        ceiling = min(missed, default=math.inf)
        passing = [p.rate for p in self.points if p.passed and p.rate < ceiling]
        return max(passing, default=None)


def runaway_reason(summary: RunSummary, rate: float, cfg: SweepConfig) -> str | None:
    """Why this run shows a backlog that would never drain (None: it does not). Over concurrency there is
    no offered rate to fall short of: only the error-rate and queue rules apply."""
    if cfg.axis is SweepAxis.CONCURRENCY:
        rate = math.inf
    error_rate = summary.error_rate
    if error_rate >= cfg.runaway_error_rate:
        return f"runaway: error rate {error_rate:.0%} >= {cfg.runaway_error_rate:.0%}"
    num_prompts = summary.num_prompts
    waiting_max = summary.server.value("num_requests_waiting_max") or 0.0
    if num_prompts >= _MIN_PROMPTS_FOR_QUEUE_RULE and waiting_max >= cfg.runaway_completion_ratio * num_prompts:
        return f"runaway: {waiting_max:.0f} of {num_prompts} requests waiting at once"
    completed_rate = summary.request_throughput
    if not math.isfinite(rate) or completed_rate >= cfg.runaway_completion_ratio * rate:
        return None
    # duration = dispatch window + drain; only when the window dominates a typical latency does a low
    # completed/offered ratio mean a growing backlog rather than a short run's drain.
    window_s = num_prompts / rate
    median_e2e_s = (summary.metric("median_e2el_ms") or 0.0) / 1000.0
    if window_s < 2.0 * median_e2e_s:
        return None
    return f"runaway: completed {completed_rate:.3g} req/s << offered {rate:.3g}"


def _spread(summaries: list[RunSummary]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for metric in SPREAD_METRICS:
        values = sorted(v for s in summaries if (v := s.metric(metric)) is not None)
        if values:
            out[metric] = {"median": values[len(values) // 2] if len(values) % 2 else
                           (values[len(values) // 2 - 1] + values[len(values) // 2]) / 2,
                           "low": values[0], "high": values[-1]}
    return out


def _server_version(run_dir: pathlib.Path) -> str:
    """The server's GET /version as recorded in the run's server.json ("unknown" if absent)."""
    path = run_dir / "server.json"
    if not path.is_file():
        return "unknown"
    return json.dumps(Fields.of(json.loads(path.read_text()), str(path)).raw("version"), sort_keys=True)


@dataclass
class PointProgress:
    """A point being measured: its repeats so far and their pooled verdict."""

    rate: float
    """Offered req/s."""
    repeats: int = 0
    """Repeats run (valid or not)."""
    summaries: list[RunSummary] = field(default_factory=list)
    """Valid repeats' summaries."""
    dirs: list[str] = field(default_factory=list)
    """Valid repeats' directories."""
    results: list[RunResult] = field(default_factory=list)
    """Valid repeats, as the verdict reads them."""
    invalid_dirs: list[str] = field(default_factory=list)
    """Invalid runs, set aside."""
    spent_s: float = 0.0
    """Run seconds spent on the point."""
    status: PointStatus = PointStatus.INVALID
    """Pooled verdict over the valid repeats (invalid until one is valid)."""
    description: str = "no valid run"
    """The bound checks, in words."""
    runaway: str | None = None
    """Why a repeat showed runaway overload (None: none did)."""
    length: Lengthening = Lengthening(None)
    """What the next repeat sends."""
    sent: list[int] = field(default_factory=list)
    """Requests each valid repeat sent."""


class Sweeper:
    """Runs the search, writing each run under `out_dir/rate-<r>-rep<k>/` and `sweep.json` after each point."""

    def __init__(self, name: str, cfg: SweepConfig, run_fn: RunFn, out_dir: pathlib.Path,
                 progress: Callable[[str], None] = print) -> None:
        self.name, self.cfg, self.run_fn, self.out_dir, self.progress = name, cfg, run_fn, out_dir, progress
        self.points: list[SweepPoint] = []
        self.summaries: list[RunSummary] = []
        self.server_versions: set[str] = set()
        self.intervals = IntervalConfig()

    def run_repeat(self, rate: float, repeat: int,
                   num_requests: int | None = None) -> tuple[pathlib.Path, RunSummary, list[str]]:
        """One repeat, re-run while invalid (up to max_invalid_reruns); returns (dir, summary, invalid dirs)."""
        run_dir = self.out_dir / run_dir_name(self.cfg.axis, rate, repeat)
        invalid: list[str] = []
        while True:
            summary = self.run_fn(rate, repeat, run_dir, num_requests)
            self.server_versions.add(_server_version(run_dir))
            if summary.valid or len(invalid) >= self.cfg.max_invalid_reruns:
                return run_dir, summary, invalid
            aside = run_dir.with_name(f"{run_dir.name}-invalid{len(invalid) + 1}")
            run_dir.rename(aside)
            invalid.append(aside.name)
            self.progress(f"[sweep {self.name}] {rate:.4g} {axis_unit(self.cfg.axis)} repeat {repeat}: INVALID "
                          f"({summary.validity.invalid_reason}); running it again")

    def wants_more(self, state: PointProgress) -> bool:
        """Another repeat: below num_repeats, or undecided and within max_repeats / max_duration_s."""
        if state.runaway is not None:
            return False
        if state.repeats < self.cfg.num_repeats:
            return True
        if state.status not in (PointStatus.UNDECIDED, PointStatus.NO_DATA, PointStatus.INVALID):
            return False
        over_time = self.cfg.max_duration_s is not None and state.spent_s >= self.cfg.max_duration_s
        return state.repeats < self.cfg.max_repeats and not over_time

    def add_repeat(self, state: PointProgress) -> None:
        """Run the point's next repeat and judge the point again on all its valid repeats."""
        run_dir, summary, invalid = self.run_repeat(state.rate, state.repeats, state.length.num_requests)
        state.repeats += 1
        state.invalid_dirs.extend(invalid)
        state.spent_s += summary.duration
        if not summary.valid:
            state.invalid_dirs.append(run_dir.name)
            return
        state.summaries.append(summary)
        state.dirs.append(run_dir.name)
        state.sent.append(requests_sent(summary))
        state.results.append(RunResult(run_dir, self.name, summary))  # requests.jsonl is read from run_dir
        state.status, verdict = point_verdict(state.results, self.cfg.slo, self.intervals)
        state.runaway = runaway_reason(summary, state.rate, self.cfg)
        if state.runaway is not None:
            state.status = PointStatus.MISSED
        self.lengthen(state, summary, verdict.not_sustained if state.runaway is None else None)
        # why a longer run did not happen matters only while the point stays undecided
        undecided = state.status is PointStatus.UNDECIDED and state.length.note is not None
        state.description = verdict.describe() + (f"; {state.length.note}" if undecided else "")

    def lengthen(self, state: PointProgress, summary: RunSummary, not_sustained: str | None) -> None:
        """Set the next repeat's length: longer when the rate was not shown sustained (lengthen.py)."""
        before = state.length
        state.length = next_length(before, summary, not_sustained, self.cfg.lengthen_factor, self.cfg.max_requests)
        where = f"[sweep {self.name}] {state.rate:.4g} {axis_unit(self.cfg.axis)}"
        if state.length.note is not None and before.note is None:
            self.progress(f"{where}: rate not shown sustained; {state.length.note}")
        elif state.length.num_requests != before.num_requests and state.length.note is None:
            self.progress(f"{where}: rate not shown sustained; a further repeat sends {state.length.num_requests} "
                          "requests")

    def finish_point(self, state: PointProgress) -> SweepPoint:
        """Record the point (sweep.json is rewritten) and report its verdict."""
        failures = [] if state.status is PointStatus.MET else (
            [state.runaway] if state.runaway else []) + [state.description]
        point = SweepPoint(state.rate, state.status.value, state.runaway is not None, state.dirs, failures,
                           _spread(state.summaries), state.invalid_dirs, state.sent)
        self.points.append(point)
        self.summaries.extend(state.summaries)
        invalid = f", {len(state.invalid_dirs)} invalid" if state.invalid_dirs else ""
        self.progress(f"[sweep {self.name}] {state.rate:.4g} {axis_unit(self.cfg.axis)}: {state.status.value.upper()} after "
                      f"{len(state.dirs)} valid repeat(s){invalid} ({state.description})"
                      + (f"; {state.runaway}" if state.runaway else ""))
        self.write()
        return point

    def run_point(self, rate: float) -> SweepPoint:
        state = PointProgress(rate)
        os.makedirs(self.out_dir, exist_ok=True)
        while self.wants_more(state):
            self.add_repeat(state)
        return self.finish_point(state)

    def bracket(self) -> tuple[float | None, float | None]:
        """(last passing, first failing) rate after the geometric search."""
        rate = first_value(self.cfg.axis, self.cfg.start_rate, self.cfg.max_rate)
        first = self.run_point(rate)
        step = self.cfg.growth_factor if first.passed else 1.0 / self.cfg.growth_factor
        good, bad = (rate, None) if first.passed else (None, rate)
        while len(self.points) < self.cfg.max_points:
            nxt = next_value(self.cfg.axis, rate, step, self.cfg.max_rate)
            if nxt == rate or any(p.rate == nxt for p in self.points):
                break
            rate = nxt
            point = self.run_point(rate)
            if point.status == PointStatus.INVALID.value:
                return good, bad  # the client cannot measure here: a rate further out would be worse
            if point.passed and step > 1:
                good = rate
            elif point.passed:
                return rate, bad
            elif step > 1:
                return good, rate
            else:
                bad = rate
        return good, bad

    def run(self) -> SweepResult:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        good, bad = self.bracket()
        for _ in range(self.cfg.bisect_steps):
            mid = None if good is None or bad is None else midpoint(self.cfg.axis, good, bad)
            if mid is None:
                break
            if self.run_point(mid).passed:
                good = mid
            else:
                bad = mid
        return self.write()

    def write(self) -> SweepResult:
        fixed = {"trace_path": sorted({s.identity.trace_path for s in self.summaries}),
                 "trace_version": sorted({s.identity.trace_version for s in self.summaries}),
                 "model": sorted({s.identity.model for s in self.summaries})}
        fixed["server_version"] = sorted(self.server_versions)
        for key in ("model_path", "weights_sha256", "tokenizer_sha256", "gpu_name", "trace_sha256"):
            fixed[key] = sorted({str(s.fixed.get(key)) for s in self.summaries})
        result = SweepResult(self.name, self.cfg.slo.to_dict(), list(self.points), fixed)
        data = asdict(result) | {"max_rate_meeting": result.max_rate_meeting, "sweep": asdict(self.cfg)}
        (self.out_dir / SWEEP_FILE).write_text(json.dumps(data, indent=2, default=str))
        return result


def run_sweep(name: str, cfg: SweepConfig, run_fn: RunFn, out_dir: pathlib.Path,
              progress: Callable[[str], None] = print) -> SweepResult:
    """Search the rate boundary of one configuration; see the module docstring."""
    return Sweeper(name, cfg, run_fn, out_dir, progress).run()
