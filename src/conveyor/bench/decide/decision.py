"""The decision: which configuration meets the objective at the lowest cost per accepted response.

The model: a *point* (configuration × offered rate) is judged on all its valid repeats pooled
(point_verdict.py): met, missed or undecided (an interval straddles a bound); invalid runs count
neither way. A configuration's *operating point* is its highest met rate below its first missed one
(a met above a miss is noise, not capacity), and its *capacity* is the interval [operating point,
first missed rate): the true limit lies in it, undecided rates included. Its cost per accepted
response, measured at the operating point over its valid repeats, is
    price per GPU-hour × GPUs × Σ run time (h) / Σ responses that completed and met the per-request bounds
so it falls as the sustainable rate rises and rises with rejections, timeouts and slow responses.
The recommendation is the cheapest configuration with an operating point. Two configurations *tie*
when their capacities per dollar (capacity / (price × GPUs): the capacity interval itself when prices
are equal) overlap: the measurements cannot tell them apart, and the report says so. A tie goes to the
earlier configuration of the study (the baseline first: a change must prove itself).
A configuration that is cheaper but never meets the objective cannot win: it has no operating point.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from conveyor.bench.decide.point_verdict import PointStatus, point_intervals, point_verdict, shown_slo, valid_runs
from conveyor.bench.decide.slo import SLO, SLOVerdict, request_meets_goodput
from conveyor.bench.measure.intervals import Interval, IntervalConfig
from conveyor.bench.measure.rundirs import Point, RunResult


@dataclass(frozen=True)
class CostModel:
    """What one configuration costs to run."""

    price_per_gpu_hour: float = 1.0
    """USD per GPU-hour (1.0 when unknown: costs are then relative units)."""
    num_gpus: int = 1
    """GPUs one server of this configuration holds."""


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
    num_accepted: int
    """Accepted responses over the valid repeats."""
    run_time_s: float
    """Σ duration over the valid repeats."""
    cost: CostModel
    """Price used."""
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
    def cost_per_accepted(self) -> float | None:
        """USD per accepted response (None: nothing was accepted)."""
        if self.num_accepted == 0:
            return None
        gpu_hours = self.cost.num_gpus * self.run_time_s / 3600.0
        return self.cost.price_per_gpu_hour * gpu_hours / self.num_accepted


def evaluate_point(point: Point, slo: SLO, cost: CostModel, cfg: IntervalConfig | None = None) -> PointEval:
    cfg = cfg or IntervalConfig()
    valid = valid_runs(point.runs)
    intervals = point_intervals(valid, shown_slo(slo), cfg) if valid else {}
    status, verdict = point_verdict(point.runs, slo, cfg, intervals)
    return PointEval(
        point=point, status=status, verdict=verdict,
        verdicts=tuple(slo.evaluate(r.summary) for r in point.runs),
        num_accepted=sum(accepted_responses(r, slo) for r in valid),
        run_time_s=sum(r.summary.duration for r in valid),
        cost=cost, intervals=intervals,
    )


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
    def undecided(self) -> list[PointEval]:
        return [p for p in self.points if p.status in (PointStatus.UNDECIDED, PointStatus.NO_DATA)]

    def first_failure(self) -> PointEval | None:
        """The first point that is not met (missed, undecided, no data; invalid ones are skipped)."""
        return next((p for p in self.points if p.status not in (PointStatus.MET, PointStatus.INVALID)), None)


class Outcome(enum.Enum):
    WINNER = "winner"
    TIE = "tie"
    UNDECIDED = "undecided"
    NO_WINNER = "no_winner"


@dataclass(frozen=True)
class Recommendation:
    """The answer: which configuration, how sure, and why in one paragraph."""

    outcome: Outcome
    """winner (decided), tie (capacities overlap; broken by study order, and said so), undecided
    (nothing is shown to meet the objective, but something may), or no_winner (everything missed)."""
    recommended: str | None
    """Configuration name (None without an operating point anywhere)."""
    tied: tuple[str, ...]
    """Configurations the measurements cannot separate from the recommended one (itself included)."""
    explanation: str
    """Human-readable reasoning with the numbers."""
    confidence: str = ""
    """One sentence: how sure the recommendation is, and why."""


def evaluate_configs(points_by_config: dict[str, list[Point]], inputs: DecisionInputs) -> list[ConfigEval]:
    return [
        ConfigEval(name, tuple(evaluate_point(p, inputs.slo, inputs.costs.get(name, inputs.default_cost),
                                              inputs.intervals) for p in points))
        for name, points in points_by_config.items()
    ]


def capacity_per_dollar(config: ConfigEval) -> Capacity:
    """Capacity / (price × GPUs) of the operating point's cost model: what a tie compares."""
    op = config.operating_point
    cost = op.cost if op is not None else CostModel()
    price = cost.price_per_gpu_hour * cost.num_gpus
    return config.capacity.scaled(1.0 / price) if price > 0 else Capacity(math.inf, math.inf)


def recommend(configs: list[ConfigEval]) -> Recommendation:
    eligible = [c for c in configs if c.cost_per_accepted is not None]
    if not eligible:
        return _without_operating_point(configs)
    cheapest = min(eligible, key=lambda c: c.cost_per_accepted or 0.0)
    tied = [c for c in eligible if c is cheapest or capacity_per_dollar(c).overlaps(capacity_per_dollar(cheapest))]
    best = tied[0]  # study order: the baseline first
    text = (f"{best.name}: meets the objective up to {best.max_rate_meeting:.3g} req/s (capacity "
            f"{best.capacity.describe()}) at {money(best.cost_per_accepted)}")
    text += "".join(f"; {_versus(c)}" for c in configs if c is not best)
    open_cases = [c.name for c in configs if c.operating_point is None and c.undecided]
    if len(tied) == 1:
        confidence = f"decided: {best.name}'s capacity per dollar is separated from every other configuration's"
        if open_cases:
            confidence += f"; not ruled out: {', '.join(open_cases)} (undecided, no operating point measured)"
        return Recommendation(Outcome.WINNER, best.name, (best.name,), text + ".", confidence + ".")
    names = ", ".join(c.name for c in tied)
    text += (f". Tie between {names}: their capacity intervals (per dollar) overlap, so the measurements cannot "
             f"tell them apart; {best.name} is chosen as the earlier configuration of the study (the baseline "
             "first: a change must prove itself).")
    confidence = (f"tie: {names} cannot be separated ("
                  + "; ".join(f"{c.name} {c.capacity.describe()}" for c in tied)
                  + "); more repeats or rates between them would be needed to separate them.")
    return Recommendation(Outcome.TIE, best.name, tuple(c.name for c in tied), text, confidence)


def money(value: float | None) -> str:
    """A cost per accepted response in words: "$0.25 per accepted response", "$0.139 per 1,000 ..."."""
    if value is None:
        return "n/a"
    if value >= 0.01:
        return f"${value:.3g} per accepted response"
    return f"${value * 1000:.3g} per 1,000 accepted responses"


def _versus(config: ConfigEval) -> str:
    if config.cost_per_accepted is None:
        failure = config.first_failure()
        if failure is None:
            return f"{config.name} has no valid measurement"
        word = "is undecided" if failure.status is not PointStatus.MISSED else "never meets the objective: missed"
        return f"{config.name} {word} at {failure.offered_rate:.3g} req/s ({failure.verdict.describe()})"
    return (f"{config.name} sustains {config.max_rate_meeting:.3g} req/s (capacity {config.capacity.describe()}) at "
            f"{money(config.cost_per_accepted)}")


def _worst_ratio(evaluated: PointEval) -> float:
    ratios = [c.measured / c.bound if c.measured is not None and c.bound > 0 else float("inf")
              for c in evaluated.verdict.failures]
    return max(ratios, default=float("inf"))


def _without_operating_point(configs: list[ConfigEval]) -> Recommendation:
    judged = [(c, p) for c in configs for p in c.points if p.status is not PointStatus.INVALID]
    if not judged:
        text = "No configuration has a valid measurement (every run was invalid: see the dashboard)."
        return Recommendation(Outcome.UNDECIDED, None, (), text, "undecided: no valid run.")
    undecided = [(c, p) for c, p in judged if p.status is not PointStatus.MISSED]
    if undecided:
        config, point = undecided[0]
        text = (f"No configuration is shown to meet the objective at any measured rate; {config.name} at "
                f"{point.offered_rate:.3g} req/s is undecided ({point.verdict.describe()}). Run more requests or "
                "repeats there (--max-repeats, --max-duration), or lower the rate.")
        unbounded = any(c.interval is not None and math.isinf(c.interval.high) for c in point.verdict.failures)
        why = ("too few requests for a p95 to be bounded from above (40 per point are needed)" if unbounded else
               point.verdict.not_sustained or "an interval straddles its bound")
        return Recommendation(Outcome.UNDECIDED, None, (), text, f"undecided: {why}.")
    config, point = min(judged, key=lambda cp: (_worst_ratio(cp[1]), cp[0].name))
    text = (f"No configuration meets every bound at any measured rate. Closest: {config.name} at "
            f"{point.offered_rate:.3g} req/s ({point.verdict.describe()}; worst bound exceeded "
            f"{_worst_ratio(point):.2g}x). Lower the offered rate, relax the objective or change the configuration.")
    return Recommendation(Outcome.NO_WINNER, None, (), text, "decided: every configuration misses the objective.")
