"""The recommendation at a glance: a headline, the reasons as a list, a confidence the checklist backs.

The headline names the configuration, its capacity interval, its one cost (cost.py, with its interval
and price, or "no price given") and the confidence in one word. The confidence line and the checklist
share one rule, so they cannot contradict each other: "decided" needs a winner whose main scenario the
checklist answers "yes", whose measurements are consistent, and that no undecided configuration may
still beat. A winner without that is "provisional", and the line says what holds it back.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from conveyor.bench.decide.decision import (
    ConfigEval,
    Outcome,
    Recommendation,
    cost_text,
    recommend,
)
from conveyor.bench.decide.decision_checklist import (
    Answer,
    ChecklistInputs,
    ChecklistItem,
    answer_checklist,
)
from conveyor.bench.decide.inconsistency import find_inconsistency


@dataclass(frozen=True)
class Decision:
    """The recommendation (its confidence agreeing with the checklist), the checklist and the headline."""

    recommendation: Recommendation
    """Outcome, configuration, reasons and the confidence line."""
    checklist: tuple[ChecklistItem, ...]
    """The guide's five questions."""
    headline: str
    """One line: configuration, capacity, cost, confidence."""

    @property
    def reasons(self) -> tuple[str, ...]:
        return self.recommendation.reasons


def not_ruled_out(config: ConfigEval) -> bool:
    """No operating point, yet it may still beat the winner: undecided below its first miss (or with no
    miss), or its measurements contradict themselves."""
    if config.operating_point is not None or not config.undecided:
        return False
    missed = config.first_missed()
    return (missed is None or find_inconsistency(config) is not None
            or any(p.offered_rate < missed.offered_rate for p in config.undecided))


def held_back(recommendation: Recommendation, checklist: tuple[ChecklistItem, ...],
              configs: list[ConfigEval]) -> list[str]:
    """What keeps a winner from being decided: the main scenario not answered "yes", an inconsistency."""
    if recommendation.outcome is not Outcome.WINNER:
        return []
    problems = []
    main = checklist[0] if checklist else None
    if main is not None and main.answer is not Answer.YES:
        problems.append(f"the checklist's main scenario is {main.answer.value} ({main.evidence})")
    best = next((c for c in configs if c.name == recommendation.recommended), None)
    inconsistent = find_inconsistency(best) if best is not None else None
    if inconsistent is not None:
        problems.append(inconsistent.describe())
    open_cases = [c for c in configs if c is not best and not_ruled_out(c)]
    problems.extend(f"{c.name} is not ruled out (undecided at {c.undecided[0].offered_rate:.3g} req/s, no operating "
                    "point measured)" for c in open_cases)
    return problems


def confidence_line(recommendation: Recommendation, checklist: tuple[ChecklistItem, ...],
                    configs: list[ConfigEval]) -> str:
    """The confidence the report prints: the recommendation's own, unless the checklist holds it back."""
    problems = held_back(recommendation, checklist, configs)
    if not problems:
        return recommendation.confidence
    return (f"provisional: {recommendation.recommended} is separated from the other configurations, but "
            + "; ".join(problems) + ".")


def headline(recommendation: Recommendation, configs: list[ConfigEval]) -> str:
    """"continuous: capacity [4, 8) req/s, cost $0.0556 [...] per 1,000 accepted responses (...); confidence:
    decided"."""
    word = recommendation.confidence.split(":", 1)[0] or recommendation.outcome.value
    best = next((c for c in configs if c.name == recommendation.recommended), None)
    if best is None:
        return f"No configuration recommended ({recommendation.outcome.value.replace('_', ' ')}); confidence: {word}"
    tied = f" (tied with {', '.join(n for n in recommendation.tied if n != best.name)})" \
        if recommendation.outcome is Outcome.TIE else ""
    unpriced = best.cost.model.describe_price() if best.cost is not None else "no price given"
    cost = f"cost {best.cost.short()}" if best.cost is not None and best.cost.per_accepted is not None else (
        f"{unpriced} (ranked by capacity per GPU)" if not recommendation.priced else f"cost {cost_text(best)}")
    return f"{best.name}{tied}: capacity {best.capacity.describe()}, {cost}; confidence: {word}"


def decide(configs: list[ConfigEval], inputs: ChecklistInputs) -> Decision:
    """Recommend, answer the checklist, then make the confidence agree with it and write the headline."""
    first = recommend(configs)
    checklist = tuple(answer_checklist(configs, first, inputs))
    recommendation = dataclasses.replace(first, confidence=confidence_line(first, checklist, configs))
    return Decision(recommendation, checklist, headline(recommendation, configs))
