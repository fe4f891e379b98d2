"""The decision: which configuration meets the objective at the lowest cost per accepted response.

The model: a *point* (configuration × offered rate) meets the objective when every repeat's summary
passes every aggregate bound (conservative: one failing repeat fails the point) and no repeat is
invalid (a client that fell behind measured itself, not the server). A configuration's
*operating point* is its highest passing rate below its first failing one (a pass above a failure is
noise, not capacity). Its cost per accepted response, measured there, is
    price per GPU-hour × GPUs × Σ run time (h) / Σ responses that completed and met the per-request bounds
so it falls as the sustainable rate rises and rises with rejections, timeouts and slow responses.
The recommendation is the cheapest configuration with an operating point; costs within `tie_tolerance`
of each other tie, and the tie is broken by the higher sustained rate, then by study order (the
baseline first: fewer changes), saying so.
A configuration that is cheaper but never meets the objective cannot win: it has no operating point.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from conveyor.bench.rundirs import Point, RunResult
from conveyor.bench.slo import SLO, SLOVerdict, request_meets_goodput


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
    tie_tolerance: float = 0.02
    """Relative cost difference under which two configurations tie."""


def accepted_responses(run: RunResult, slo: SLO) -> int:
    """Responses that completed and met every per-request bound (all completed when none is set)."""
    completed = int(run.summary.get("completed") or 0)
    if not slo.goodput_bounds():
        return completed
    records = run.requests()
    if records:
        return sum(1 for r in records if request_meets_goodput(slo, r))
    goodput, duration = run.summary.get("goodput"), run.summary.get("duration")
    if goodput is not None and duration:
        return round(float(goodput) * float(duration))
    return completed


@dataclass(frozen=True)
class PointEval:
    """One point judged: verdict per repeat, accepted responses and cost."""

    point: Point
    """The repeats."""
    verdicts: tuple[SLOVerdict, ...]
    """One per repeat, in run order."""
    num_accepted: int
    """Accepted responses over all repeats."""
    run_time_s: float
    """Σ duration over repeats."""
    cost: CostModel
    """Price used."""

    @property
    def offered_rate(self) -> float:
        return self.point.offered_rate

    @property
    def invalid_runs(self) -> list[str]:
        """Labels of repeats whose client fell behind (RUNDIR `valid: false`): not evidence either way."""
        return [r.label for r in self.point.runs if r.summary.get("valid") is False]

    @property
    def passed(self) -> bool:
        """Every repeat met every bound, and every repeat is a valid measurement."""
        return bool(self.verdicts) and all(v.passed for v in self.verdicts) and not self.invalid_runs

    @property
    def cost_per_accepted(self) -> float | None:
        """USD per accepted response (None: nothing was accepted)."""
        if self.num_accepted == 0:
            return None
        gpu_hours = self.cost.num_gpus * self.run_time_s / 3600.0
        return self.cost.price_per_gpu_hour * gpu_hours / self.num_accepted


def evaluate_point(point: Point, slo: SLO, cost: CostModel) -> PointEval:
    return PointEval(
        point=point,
        verdicts=tuple(slo.evaluate(r.summary) for r in point.runs),
        num_accepted=sum(accepted_responses(r, slo) for r in point.runs),
        run_time_s=sum(float(r.summary.get("duration") or 0.0) for r in point.runs),
        cost=cost,
    )


@dataclass(frozen=True)
class ConfigEval:
    """One configuration's points, judged in increasing offered rate."""

    name: str
    """Configuration name."""
    points: tuple[PointEval, ...]
    """Increasing offered rate."""

    @property
    def operating_point(self) -> PointEval | None:
        """Highest passing point below the first failing one."""
        best = None
        for evaluated in self.points:
            if not evaluated.passed:
                break
            best = evaluated
        return best

    @property
    def max_rate_meeting(self) -> float | None:
        op = self.operating_point
        return None if op is None else op.offered_rate

    @property
    def cost_per_accepted(self) -> float | None:
        op = self.operating_point
        return None if op is None else op.cost_per_accepted

    def first_failure(self) -> PointEval | None:
        return next((p for p in self.points if not p.passed), None)


class Outcome(enum.Enum):
    WINNER = "winner"
    TIE = "tie"
    NO_WINNER = "no_winner"


@dataclass(frozen=True)
class Recommendation:
    """The answer: which configuration, and why in one paragraph."""

    outcome: Outcome
    """winner, tie (broken, and said so) or no_winner."""
    recommended: str | None
    """Configuration name (None when no configuration meets the objective)."""
    tied: tuple[str, ...]
    """Configurations whose cost ties with the recommended one (itself included)."""
    explanation: str
    """Human-readable reasoning with the numbers."""


def evaluate_configs(points_by_config: dict[str, list[Point]], inputs: DecisionInputs) -> list[ConfigEval]:
    return [
        ConfigEval(name, tuple(evaluate_point(p, inputs.slo, inputs.costs.get(name, inputs.default_cost))
                               for p in points))
        for name, points in points_by_config.items()
    ]


def recommend(configs: list[ConfigEval], tie_tolerance: float = 0.02) -> Recommendation:
    eligible = [c for c in configs if c.cost_per_accepted is not None]
    if not eligible:
        return Recommendation(Outcome.NO_WINNER, None, (), _no_winner_text(configs))
    cheapest = min(c.cost_per_accepted or 0.0 for c in eligible)
    tied = [c for c in eligible if (c.cost_per_accepted or 0.0) <= cheapest * (1.0 + tie_tolerance)]
    order = {c.name: i for i, c in enumerate(configs)}  # study order: the baseline first
    tied.sort(key=lambda c: (-(c.max_rate_meeting or 0.0), order[c.name]))
    best = tied[0]
    text = (f"{best.name}: meets every bound up to {best.max_rate_meeting:g} req/s at "
            f"{_money(best.cost_per_accepted)} per accepted response")
    others = [c for c in configs if c.name != best.name]
    text += "".join(f"; {_versus(c)}" for c in others)
    if len(tied) == 1:
        return Recommendation(Outcome.WINNER, best.name, (best.name,), text + ".")
    names = ", ".join(c.name for c in tied)
    text += (f". Tie within {tie_tolerance:.0%} on cost between {names}: {best.name} is chosen for the "
             "higher sustained rate, then as the earlier configuration of the study (the baseline first).")
    return Recommendation(Outcome.TIE, best.name, tuple(c.name for c in tied), text)


def _money(value: float | None) -> str:
    return "n/a" if value is None else f"${value:.3g}"


def _versus(config: ConfigEval) -> str:
    if config.cost_per_accepted is None:
        failure = config.first_failure()
        why = failure.verdicts[0].describe() if failure and failure.verdicts else "no run"
        return f"{config.name} never meets the objective (at its lowest rate: {why})"
    return (f"{config.name} sustains {config.max_rate_meeting:g} req/s at "
            f"{_money(config.cost_per_accepted)} per accepted response")


def _worst_ratio(evaluated: PointEval) -> float:
    ratios = [c.measured / c.bound if c.measured is not None and c.bound > 0 else float("inf")
              for v in evaluated.verdicts for c in v.failures]
    return max(ratios, default=float("inf"))


def _no_winner_text(configs: list[ConfigEval]) -> str:
    candidates = [(min((_worst_ratio(p) for p in c.points), default=float("inf")), c) for c in configs]
    if not candidates:
        return "No configuration was measured."
    ratio, closest = min(candidates, key=lambda rc: (rc[0], rc[1].name))
    point = min(closest.points, key=_worst_ratio, default=None)
    detail = point.verdicts[0].describe() if point and point.verdicts else "no data"
    return (f"No configuration meets every bound at any measured rate. Closest: {closest.name} at "
            f"{point.offered_rate if point else 0:g} req/s ({detail}; worst bound exceeded {ratio:.2g}x). "
            "Lower the offered rate, relax the objective or change the configuration.")
