"""The guide's decision checklist, answered with the numbers that support each answer.

Five questions about the recommended configuration (or, without one, the closest): objective met at
the main scenario; what a burst above normal does (bounded queue, rejection, or latency blow-up);
preemptions and KV pressure stable; reproducible across repeats; cheaper per accepted response than
the alternative. Each answer is yes / no / unknown (not enough data to say), never a guess.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from conveyor.bench.decision import ConfigEval, PointEval, Recommendation

REPRODUCIBLE_SPREAD = 0.15
"""Largest relative range over repeats of throughput and p95 latencies still called reproducible."""
KV_PRESSURE_MAX = 0.95
"""KV usage peak above which the cache is under pressure."""
PREEMPTIONS_PER_REQUEST_MAX = 0.01
"""Preemptions per completed request above which preemption is not a rare event."""
TIE_TOLERANCE = 0.02
"""Cost differences under this fraction are a tie (as the recommendation's)."""
BLOWUP_FACTOR = 2.0
"""Latency growth over the operating point that counts as a blow-up."""


class Answer(enum.Enum):
    YES = "yes"
    NO = "no"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class ChecklistItem:
    """One question, its answer, and the evidence."""

    question: str
    """The guide's question."""
    answer: Answer
    """yes / no / unknown."""
    evidence: str
    """The numbers behind the answer."""


def _main_point(config: ConfigEval, main_rate: float | None) -> PointEval | None:
    if not config.points:
        return None
    if main_rate is None:
        return config.points[0]
    return min(config.points, key=lambda p: abs(p.offered_rate - main_rate))


def main_scenario(config: ConfigEval, main_rate: float | None) -> ChecklistItem:
    question = "Does the main traffic scenario meet the p95 TTFT and end-to-end objectives?"
    point = _main_point(config, main_rate)
    if point is None or not point.verdicts:
        return ChecklistItem(question, Answer.UNKNOWN, f"{config.name}: no run at the main rate")
    answer = Answer.YES if point.passed else Answer.NO
    shown = next((v for v in point.verdicts if not v.passed), point.verdicts[0])
    num_met = sum(v.passed for v in point.verdicts)
    return ChecklistItem(question, answer, f"{config.name} at {point.offered_rate:g} req/s, {num_met}/"
                                           f"{len(point.verdicts)} repeats met: {shown.describe()}")


def _burst_mode(over: PointEval, base: PointEval) -> tuple[Answer, str]:
    errors: dict[str, int] = {}
    for run in over.point.runs:
        for kind, count in (run.summary.get("errors_by_kind") or {}).items():
            errors[kind] = errors.get(kind, 0) + int(count)
    rejected = errors.get("http_503", 0) + errors.get("http_429", 0)
    timed_out = errors.get("timeout", 0)
    growths, shown = [], []
    for metric, name in (("p95_ttft_ms", "TTFT"), ("p95_e2el_ms", "E2E")):
        value_over, value_base = over.point.median(metric), base.point.median(metric)
        if value_over and value_base:
            growths.append(value_over / value_base)
            shown.append(f"p95 {name} {value_base:.0f} -> {value_over:.0f} ms")
    waiting = over.point.median("num_requests_waiting_max")
    detail = ", ".join(shown + [f"waiting peak {waiting or 0:.0f}"])
    growth = max(growths, default=0.0)
    if rejected or timed_out:
        return Answer.YES, f"bounded: {rejected} rejected (503/429), {timed_out} timed out; {detail}"
    if growth >= BLOWUP_FACTOR:
        return Answer.NO, f"latency blow-up ({growth:.1f}x), queue unbounded, no rejection; {detail}"
    return Answer.YES, f"degrades gracefully (at most {growth:.1f}x); {detail}"


def burst(config: ConfigEval) -> ChecklistItem:
    question = ("Above the normal rate: bounded queue or rejection (yes), or a latency blow-up (no)?")
    base = config.operating_point
    above = [p for p in config.points if base is not None and p.offered_rate > base.offered_rate]
    if base is None:
        return ChecklistItem(question, Answer.UNKNOWN, f"{config.name}: no operating point (the objective is not "
                                                       "met at its lowest measured rate)")
    if not above:
        return ChecklistItem(question, Answer.UNKNOWN, f"{config.name}: no measured rate above the operating point")
    answer, text = _burst_mode(above[0], base)
    return ChecklistItem(question, answer, f"{config.name} at {above[0].offered_rate:g} req/s "
                                           f"(operating point {base.offered_rate:g}): {text}")


def kv_stability(config: ConfigEval) -> ChecklistItem:
    question = "Are preemptions and KV cache pressure stable at the planned context length?"
    point = config.operating_point or (config.points[0] if config.points else None)
    if point is None:
        return ChecklistItem(question, Answer.UNKNOWN, "no run")
    preemptions = [r.metric("num_preemptions") for r in point.point.runs]
    kv_peaks = [r.metric("kv_cache_usage_max") for r in point.point.runs]
    if any(v is None for v in preemptions + kv_peaks):
        return ChecklistItem(question, Answer.UNKNOWN, f"{config.name}: server metrics not available")
    completed = sum(int(r.summary.get("completed") or 0) for r in point.point.runs) or 1
    per_request = sum(preemptions) / completed  # type: ignore[arg-type]
    peak = max(kv_peaks)  # type: ignore[type-var]
    stable = per_request <= PREEMPTIONS_PER_REQUEST_MAX and peak <= KV_PRESSURE_MAX  # type: ignore[operator]
    evidence = (f"{config.name} at {point.offered_rate:g} req/s: preemptions {[int(p or 0) for p in preemptions]} "
                f"per repeat ({per_request:.3f}/request), KV usage peak {peak:.0%}")
    return ChecklistItem(question, Answer.YES if stable else Answer.NO, evidence)


def reproducibility(config: ConfigEval) -> ChecklistItem:
    question = "Is the result reproducible (same model revision and configuration, across repeats)?"
    point = config.operating_point or (config.points[0] if config.points else None)
    if point is None or len(point.point.runs) < 2:
        return ChecklistItem(question, Answer.UNKNOWN, f"{config.name}: fewer than 2 repeats")
    parts, worst = [], 0.0
    for metric in ("request_throughput", "p95_ttft_ms", "p95_e2el_ms"):
        spread = point.point.spread(metric)
        if spread is not None:
            worst = max(worst, spread.relative)
            parts.append(f"{metric} {spread.low:.4g}..{spread.high:.4g} ({spread.relative:.0%})")
    versions = {str(r.server_info.get("version")) for r in point.point.runs}
    models = {str(r.summary.get("model")) for r in point.point.runs}
    same = len(versions) == 1 and len(models) == 1
    answer = Answer.YES if worst <= REPRODUCIBLE_SPREAD and same else Answer.NO
    note = "" if same else f"; runs differ in model/version {sorted(models)} {sorted(versions)}"
    return ChecklistItem(question, answer, f"{config.name}, {len(point.point.runs)} repeats at "
                                           f"{point.offered_rate:g} req/s: " + ", ".join(parts) + note)


def cheaper(configs: list[ConfigEval], recommendation: Recommendation) -> ChecklistItem:
    question = "Is the cost per accepted response lower than the alternative's?"
    best = next((c for c in configs if c.name == recommendation.recommended), None)
    others = [c for c in configs if best is None or c.name != best.name]
    if best is None or not others:
        return ChecklistItem(question, Answer.UNKNOWN, "no recommended configuration or no alternative")
    costs = []
    for other in others:
        if other.cost_per_accepted is None:
            costs.append(f"{other.name} never meets the objective")
        else:
            ratio = other.cost_per_accepted / (best.cost_per_accepted or 1.0)
            costs.append(f"{other.name} ${other.cost_per_accepted:.3g} ({ratio:.2f}x)")
    margin = 1.0 + TIE_TOLERANCE
    clearly = all(o.cost_per_accepted is None or o.cost_per_accepted > (best.cost_per_accepted or 0.0) * margin
                  for o in others)
    evidence = f"{best.name} ${best.cost_per_accepted:.3g} per accepted response vs " + "; ".join(costs)
    if not clearly:
        evidence += f" (within {TIE_TOLERANCE:.0%}: a tie, not a saving)"
    return ChecklistItem(question, Answer.YES if clearly else Answer.NO, evidence)


def answer_checklist(configs: list[ConfigEval], recommendation: Recommendation,
                     main_rate: float | None) -> list[ChecklistItem]:
    """The five answers for the recommended configuration (else the first one measured)."""
    subject = next((c for c in configs if c.name == recommendation.recommended), configs[0] if configs else None)
    if subject is None:
        return []
    return [main_scenario(subject, main_rate), burst(subject), kv_stability(subject),
            reproducibility(subject), cheaper(configs, recommendation)]
