"""Judging configurations: each point over its valid repeats, each configuration's operating point,
capacity and cost.

A *point* (configuration × offered rate) is judged on all its valid repeats pooled (point_verdict.py):
met, missed or undecided; invalid runs count neither way. A configuration's *operating point* is its
highest met rate below its first missed one (a met above a miss is an inconsistent measurement, not
capacity: inconsistency.py names its likely cause), and its *capacity* is the interval [operating point,
first missed rate): the true limit lies in it, undecided rates included. Its cost per accepted response
is measured at the operating point (cost.py: one function, shown everywhere with its inputs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from conveyor.bench.decide.cost import Cost, CostModel
from conveyor.bench.decide.point_verdict import (
    PointStatus,
    point_intervals,
    point_verdict,
    shown_slo,
    valid_runs,
)
from conveyor.bench.decide.slo import SLO, SLOVerdict, request_meets_goodput
from conveyor.bench.measure.intervals import Interval, IntervalConfig
from conveyor.bench.measure.rundirs import Point, RunResult


@dataclass(frozen=True)
class DecisionInputs:
    """The objective and prices the decision is taken against."""

    slo: SLO
    """Bounds every point is checked against."""
    default_cost: CostModel = CostModel()
    """Cost of a configuration not named in `costs`."""
    costs: dict[str, CostModel] = field(default_factory=dict)
    """Per-configuration cost (e.g. a variant on another GPU)."""
    main_rate: float | None = None
    """Offered rate of the main traffic scenario (None: the lowest rate measured)."""
    intervals: IntervalConfig = IntervalConfig()
    """Confidence level and bootstrap settings."""


def accepted_responses(run: RunResult, slo: SLO) -> int:
    """Responses that completed and met every per-request bound (all completed when none is set)."""
    completed = run.summary.completed
    if not slo.goodput_bounds():
        return completed
    records = [r for r in run.requests() if r.in_window]  # the steady-state window only
    if records:
        return sum(1 for r in records if request_meets_goodput(slo, r))
    goodput, duration = run.summary.goodput, run.summary.duration
    if goodput is not None and duration:
        return round(goodput * duration)
    return completed


@dataclass(frozen=True)
class PointEval:
    """One point judged over its valid repeats: status, per-run verdicts, accepted responses and cost."""

    point: Point
    """The repeats (invalid ones included: they are shown, not counted)."""
    status: PointStatus
    """met / missed / undecided / no_data over the valid repeats pooled; invalid when none is valid."""
    verdict: SLOVerdict
    """The pooled bound checks."""
    verdicts: tuple[SLOVerdict, ...]
    """Each run's own verdict, in run order (for the dashboard)."""
    cost: Cost
    """USD per accepted response over the valid repeats, with its interval and inputs (cost.py)."""
    intervals: dict[str, Interval] = field(default_factory=dict)
    """Summary key -> interval pooled over the valid repeats (the objective's, the dashboard's, the rates)."""

    @property
    def offered_rate(self) -> float:
        return self.point.offered_rate

    @property
    def invalid_runs(self) -> list[str]:
        """Labels of repeats that measured the client, not the server (RUNDIR `valid: false`)."""
        return [r.label for r in self.point.runs if not r.valid]

    @property
    def valid_runs(self) -> list[RunResult]:
        return valid_runs(self.point.runs)

    @property
    def passed(self) -> bool:
        return self.status is PointStatus.MET

    @property
    def num_accepted(self) -> int:
        return self.cost.num_accepted

    @property
    def cost_per_accepted(self) -> float | None:
        """USD per accepted response (None: no price given, or nothing accepted)."""
        return self.cost.per_accepted


def evaluate_point(point: Point, slo: SLO, cost: CostModel, cfg: IntervalConfig | None = None) -> PointEval:
    cfg = cfg or IntervalConfig()
    valid = valid_runs(point.runs)
    intervals = point_intervals(valid, shown_slo(slo), cfg) if valid else {}
    status, verdict = point_verdict(point.runs, slo, cfg, intervals)
    # the whole run's accepted rate: goodput when per-request bounds decide acceptance, else completions
    rate = intervals.get("goodput") if slo.goodput_bounds() else None
    measured = Cost(cost, sum(r.summary.duration for r in valid), sum(accepted_responses(r, slo) for r in valid),
                    rate or intervals.get("request_throughput"), intervals.get("steady_accepted_rate"))
    return PointEval(point=point, status=status, verdict=verdict,
                     verdicts=tuple(slo.evaluate(r.summary) for r in point.runs), cost=measured, intervals=intervals)


@dataclass(frozen=True)
class Capacity:
    """Where the highest rate meeting the objective lies: [low, high) req/s."""

    low: float
    """The operating point's rate (0: none met)."""
    high: float
    """The first missed rate above it (inf: none missed)."""

    def scaled(self, factor: float) -> Capacity:
        return Capacity(self.low * factor, self.high * factor)

    def overlaps(self, other: Capacity) -> bool:
        return self.low < other.high and other.low < self.high

    def describe(self) -> str:
        high = "not reached" if math.isinf(self.high) else f"{self.high:.3g}"
        return f"[{self.low:.3g}, {high}) req/s"


@dataclass(frozen=True)
class ConfigEval:
    """One configuration's points, judged in increasing offered rate."""

    name: str
    """Configuration name."""
    points: tuple[PointEval, ...]
    """Increasing offered rate."""

    def first_missed(self) -> PointEval | None:
        return next((p for p in self.points if p.status is PointStatus.MISSED), None)

    @property
    def operating_point(self) -> PointEval | None:
        """Highest met point below the first missed one."""
        ceiling = self.first_missed()
        met = [p for p in self.points if p.passed and (ceiling is None or p.offered_rate < ceiling.offered_rate)]
        return met[-1] if met else None

    @property
    def capacity(self) -> Capacity:
        op, missed = self.operating_point, self.first_missed()
        return Capacity(0.0 if op is None else op.offered_rate, math.inf if missed is None else missed.offered_rate)

    @property
    def max_rate_meeting(self) -> float | None:
        op = self.operating_point
        return None if op is None else op.offered_rate

    @property
    def cost_per_accepted(self) -> float | None:
        op = self.operating_point
        return None if op is None else op.cost_per_accepted

    @property
    def cost(self) -> Cost | None:
        """The one cost: at the operating point (None: there is none)."""
        op = self.operating_point
        return None if op is None else op.cost

    @property
    def undecided(self) -> list[PointEval]:
        return [p for p in self.points if p.status in (PointStatus.UNDECIDED, PointStatus.NO_DATA)]

    def first_failure(self) -> PointEval | None:
        """The first point that is not met (missed, undecided, no data; invalid ones are skipped)."""
        return next((p for p in self.points if p.status not in (PointStatus.MET, PointStatus.INVALID)), None)


def evaluate_configs(points_by_config: dict[str, list[Point]], inputs: DecisionInputs) -> list[ConfigEval]:
    return [
        ConfigEval(name, tuple(evaluate_point(p, inputs.slo, inputs.costs.get(name, inputs.default_cost),
                                              inputs.intervals) for p in points))
        for name, points in points_by_config.items()
    ]


