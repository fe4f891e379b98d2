"""The decision: which configuration meets the objective at the lowest cost per accepted response.

The configurations are judged in evaluation.py (points, operating point, capacity) and priced in
cost.py (one cost, shown with its inputs). The recommendation is the cheapest configuration with an
operating point. Without a price for every such configuration there is no cost to compare (no price
is built in), so the recommendation is the highest capacity per GPU, and it says so. Two
configurations *tie* when their capacities per dollar (capacity / (price × GPUs); per GPU without
prices) overlap: the measurements cannot tell them apart, and the report says so. A tie goes to the
earlier configuration of the study (the baseline first: a change must prove itself). A configuration
that is cheaper but never meets the objective cannot win: it has no operating point. One that misses
at a lower rate and meets at a higher one is an inconsistent measurement (inconsistency.py), said as
such with its likely cause, never "never meets".
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass

from conveyor.bench.decide.cost import Cost, CostModel, money
from conveyor.bench.decide.evaluation import (
    Capacity,
    ConfigEval,
    DecisionInputs,
    PointEval,
    accepted_responses,
    evaluate_configs,
    evaluate_point,
)
from conveyor.bench.decide.inconsistency import find_inconsistency
from conveyor.bench.decide.point_verdict import PointStatus

__all__ = ["Capacity", "ConfigEval", "Cost", "CostModel", "DecisionInputs", "Outcome", "PointEval", "Recommendation",
           "accepted_responses", "evaluate_configs", "evaluate_point", "money", "recommend"]


class Outcome(enum.Enum):
    WINNER = "winner"
    TIE = "tie"
    UNDECIDED = "undecided"
    NO_WINNER = "no_winner"


@dataclass(frozen=True)
class Recommendation:
    """The answer: which configuration, how sure, and why, as a list of reasons."""

    outcome: Outcome
    """winner (decided), tie (capacities overlap; broken by study order, and said so), undecided
    (nothing is shown to meet the objective, but something may), or no_winner (everything missed)."""
    recommended: str | None
    """Configuration name (None without an operating point anywhere)."""
    tied: tuple[str, ...]
    """Configurations the measurements cannot separate from the recommended one (itself included)."""
    reasons: tuple[str, ...]
    """Why, one sentence each, with the numbers: the recommended configuration first, then each other."""
    confidence: str = ""
    """One sentence: how sure the recommendation is, and why (headline.py makes it agree with the checklist)."""
    priced: bool = True
    """Ranked by cost per accepted response (False: some configuration has no price; ranked by capacity per GPU)."""

    @property
    def explanation(self) -> str:
        return " ".join(r if r.endswith(".") else r + "." for r in self.reasons)


def capacity_per_dollar(config: ConfigEval) -> Capacity:
    """Capacity / (price × GPUs) of the operating point's cost model: what a tie compares."""
    op = config.operating_point
    model = op.cost.model if op is not None else CostModel()
    price = (model.price_per_gpu_hour or 0.0) * model.num_gpus
    return config.capacity.scaled(1.0 / price) if price > 0 else Capacity(math.inf, math.inf)


def capacity_per_gpu(config: ConfigEval) -> Capacity:
    """Capacity / GPUs: what the decision compares when not every configuration has a price."""
    op = config.operating_point
    gpus = op.cost.model.num_gpus if op is not None else 1
    return config.capacity.scaled(1.0 / max(1, gpus))


def _is_priced(config: ConfigEval) -> bool:
    return config.cost_per_accepted is not None


def recommend(configs: list[ConfigEval]) -> Recommendation:
    eligible = [c for c in configs if c.operating_point is not None]
    if not eligible:
        return _without_operating_point(configs)
    priced = all(_is_priced(c) for c in eligible)
    compare: Callable[[ConfigEval], Capacity] = capacity_per_dollar if priced else capacity_per_gpu
    best = (min(eligible, key=lambda c: c.cost_per_accepted or 0.0) if priced else
            max(eligible, key=lambda c: capacity_per_gpu(c).low))
    tied = [c for c in eligible if c is best or compare(c).overlaps(compare(best))]
    best = tied[0]  # study order: the baseline first
    per = "per dollar" if priced else "per GPU"
    reasons = [_lead(best, priced), *(_versus(c) for c in configs if c is not best)]
    if len(tied) == 1:
        confidence = f"decided: {best.name}'s capacity {per} is separated from every other configuration's"
        open_cases = [c.name for c in configs if c.operating_point is None and c.undecided]
        if open_cases:
            confidence += f"; not ruled out: {', '.join(open_cases)} (undecided, no operating point measured)"
        return Recommendation(Outcome.WINNER, best.name, (best.name,), tuple(reasons), confidence + ".", priced)
    names = ", ".join(c.name for c in tied)
    reasons.append(f"Tie between {names}: their capacity intervals ({per}) overlap, so the measurements cannot tell "
                   f"them apart; {best.name} is chosen as the earlier configuration of the study (the baseline "
                   "first: a change must prove itself).")
    confidence = (f"tie: {names} cannot be separated (" + "; ".join(f"{c.name} {c.capacity.describe()}" for c in tied)
                  + "); more repeats or rates between them would be needed to separate them.")
    return Recommendation(Outcome.TIE, best.name, tuple(c.name for c in tied), tuple(reasons), confidence, priced)


def cost_text(config: ConfigEval) -> str:
    """The configuration's one cost as every view shows it (cost.py), or why there is none."""
    cost = config.cost
    if cost is None:
        return "no operating point, so no cost"
    return cost.describe()


def _at_cost(config: ConfigEval) -> str:
    """" at $0.139 ... per accepted response", or "; no price given for H100" (a price is no place)."""
    cost = config.cost
    return f"; {cost_text(config)}" if cost is not None and not cost.model.priced else f" at {cost_text(config)}"


def _lead(best: ConfigEval, priced: bool) -> str:
    text = (f"{best.name}: meets the objective up to {best.max_rate_meeting:.3g} req/s (capacity "
            f"{best.capacity.describe()}){_at_cost(best)}")
    if not priced:
        gpus = best.operating_point.cost.model.num_gpus if best.operating_point else 1
        text += (f"; not every configuration has a price, so they are ranked by capacity per GPU "
                 f"({capacity_per_gpu(best).describe()} per GPU, {gpus} GPU(s) per server)")
    inconsistent = find_inconsistency(best)
    return text + (f"; {inconsistent.describe()}" if inconsistent is not None else "")


def _versus(config: ConfigEval) -> str:
    inconsistent = find_inconsistency(config)
    if config.operating_point is None:
        if inconsistent is not None:
            return inconsistent.describe()
        failure = config.first_failure()
        if failure is None:
            return f"{config.name} has no valid measurement"
        word = "is undecided" if failure.status is not PointStatus.MISSED else "never meets the objective: missed"
        return f"{config.name} {word} at {failure.offered_rate:.3g} req/s ({failure.verdict.describe()})"
    text = (f"{config.name} sustains {config.max_rate_meeting:.3g} req/s (capacity {config.capacity.describe()})"
            f"{_at_cost(config)}")
    return text + (f"; {inconsistent.describe()}" if inconsistent is not None else "")


def _worst_ratio(evaluated: PointEval) -> float:
    ratios = [c.measured / c.bound if c.measured is not None and c.bound > 0 else float("inf")
              for c in evaluated.verdict.failures]
    return max(ratios, default=float("inf"))


def _without_operating_point(configs: list[ConfigEval]) -> Recommendation:
    judged = [(c, p) for c in configs for p in c.points if p.status is not PointStatus.INVALID]
    if not judged:
        text = "No configuration has a valid measurement (every run was invalid: see the dashboard)."
        return Recommendation(Outcome.UNDECIDED, None, (), (text,), "undecided: no valid run.")
    contradicted = [i for i in (find_inconsistency(c) for c in configs) if i is not None]
    if contradicted:
        reasons = ("No configuration is shown to meet the objective below a rate it misses.",
                   *(i.describe() for i in contradicted), "Repeat those points before deciding.")
        return Recommendation(Outcome.UNDECIDED, None, (), reasons,
                              f"undecided: inconsistent measurement ({contradicted[0].describe()}).")
    undecided = [(c, p) for c, p in judged if p.status is not PointStatus.MISSED]
    if undecided:
        config, point = undecided[0]
        text = (f"No configuration is shown to meet the objective at any measured rate; {config.name} at "
                f"{point.offered_rate:.3g} req/s is undecided ({point.verdict.describe()}). Run more requests or "
                "repeats there (--max-repeats, --max-duration), or lower the rate.")
        unbounded = any(c.interval is not None and math.isinf(c.interval.high) for c in point.verdict.failures)
        why = ("too few requests for a p95 to be bounded from above (40 per point are needed)" if unbounded else
               point.verdict.not_sustained or "an interval straddles its bound")
        return Recommendation(Outcome.UNDECIDED, None, (), (text,), f"undecided: {why}.")
    config, point = min(judged, key=lambda cp: (_worst_ratio(cp[1]), cp[0].name))
    text = (f"No configuration meets every bound at any measured rate. Closest: {config.name} at "
            f"{point.offered_rate:.3g} req/s ({point.verdict.describe()}; worst bound exceeded "
            f"{_worst_ratio(point):.2g}x). Lower the offered rate, relax the objective or change the configuration.")
    return Recommendation(Outcome.NO_WINNER, None, (), (text,), "decided: every configuration misses the objective.")
