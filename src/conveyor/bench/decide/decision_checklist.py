"""The guide's decision checklist, answered with the numbers that support each answer.

Five questions about the recommended configuration (or, without one, the first measured), as the
guide asks them: (1) does the main traffic scenario meet the p95 TTFT and end-to-end objectives;
(2) above the normal rate, a bounded queue or rejection, or a latency blow-up; (3) are preemptions and
KV pressure stable *at the planned context length* (a study's `planned_context_len`; a variant that
changes the trace can measure it); (4) is the result reproducible with the exact model revision and GPU
configuration (the recorded fixed things agree and are known, and the repeats agree); (5) is the cost
per accepted response lower than the alternative's *after retries and the capacity left unused* (whole
servers provisioned for the main rate). Each answer is yes / no / unknown (not enough data), never a
guess; invalid runs are never evidence.
"""

from __future__ import annotations

import enum
import math
from collections import Counter
from dataclasses import dataclass, field

from conveyor.bench.decide.decision import ConfigEval, Outcome, PointEval, Recommendation, cost_text
from conveyor.bench.decide.point_verdict import PointStatus
from conveyor.bench.measure.fixed import FixedDifference

REPRODUCIBLE_SPREAD = 0.15
"""Largest relative range over repeats of throughput and p95 latencies still called reproducible."""
KV_PRESSURE_MAX = 0.95
"""KV usage peak above which the cache is under pressure."""
PREEMPTIONS_PER_REQUEST_MAX = 0.01
"""Preemptions per completed request above which preemption is not a rare event."""
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


@dataclass(frozen=True)
class ChecklistInputs:
    """What the questions need besides the judged configurations."""

    main_rate: float | None = None
    """Offered rate of the main scenario (None: the lowest measured)."""
    planned_context_len: int | None = None
    """Context length (prompt + output tokens) the deployment plans for (None: not given)."""
    fixed_differences: list[FixedDifference] = field(default_factory=list)
    """Fixed things on which the compared runs disagree."""
    fixed_unknown: list[str] = field(default_factory=list)
    """Fixed things some run did not record."""


def _main_point(config: ConfigEval, main_rate: float | None) -> PointEval | None:
    points = [p for p in config.points if p.status is not PointStatus.INVALID]
    if not points:
        return None
    if main_rate is None:
        return points[0]
    return min(points, key=lambda p: abs(p.offered_rate - main_rate))


def main_scenario(config: ConfigEval, main_rate: float | None) -> ChecklistItem:
    question = "Does the main traffic scenario meet the p95 TTFT and end-to-end objectives?"
    point = _main_point(config, main_rate)
    if point is None:
        return ChecklistItem(question, Answer.UNKNOWN, f"{config.name}: no valid run at the main rate")
    answer = {PointStatus.MET: Answer.YES, PointStatus.MISSED: Answer.NO}.get(point.status, Answer.UNKNOWN)
    repeats = f"{len(point.valid_runs)} valid repeat(s)" + (f", {len(point.invalid_runs)} invalid set aside"
                                                           if point.invalid_runs else "")
    return ChecklistItem(question, answer, f"{config.name} at {point.offered_rate:.3g} req/s ({repeats}): "
                                           f"{point.status.value}: {point.verdict.describe()}")


def _burst_mode(over: PointEval, base: PointEval) -> tuple[Answer, str]:
    errors = Counter[str]()  # failures by kind over the repeats; a kind no run saw counts 0
    for run in over.valid_runs:
        errors.update(run.summary.errors_by_kind)
    rejected = errors["http_503"] + errors["http_429"]
    timed_out = errors["timeout"]
    growths, shown = [], []
    for metric, name in (("p95_ttft_ms", "TTFT"), ("p95_e2el_ms", "E2E")):
        value_over, value_base = _median(over, metric), _median(base, metric)
        if value_over and value_base:
            growths.append(value_over / value_base)
            shown.append(f"p95 {name} {value_base:,.0f} -> {value_over:,.0f} ms")
    waiting = _median(over, "num_requests_waiting_max")
    detail = ", ".join(shown + [f"waiting peak {waiting or 0:.0f}"])
    growth = max(growths, default=0.0)
    if rejected or timed_out:
        return Answer.YES, f"bounded: {rejected} rejected (503/429), {timed_out} timed out; {detail}"
    if growth >= BLOWUP_FACTOR:
        return Answer.NO, f"latency blow-up ({growth:.1f}x), queue unbounded, no rejection; {detail}"
    return Answer.YES, f"degrades gracefully (at most {growth:.1f}x); {detail}"


def _median(point: PointEval, metric: str) -> float | None:
    values = sorted(v for v in (r.metric(metric) for r in point.valid_runs) if v is not None)
    return values[len(values) // 2] if values else None


def burst(config: ConfigEval) -> ChecklistItem:
    question = "Above the normal rate: bounded queue or rejection (yes), or a latency blow-up (no)?"
    base = config.operating_point
    if base is None:
        return ChecklistItem(question, Answer.UNKNOWN, f"{config.name}: no operating point (the objective is not "
                                                       "shown to be met at any measured rate)")
    above = [p for p in config.points if p.offered_rate > base.offered_rate and p.valid_runs]
    if not above:
        return ChecklistItem(question, Answer.UNKNOWN, f"{config.name}: no valid rate above the operating point")
    answer, text = _burst_mode(above[-1], base)
    return ChecklistItem(question, answer, f"{config.name} at {above[-1].offered_rate:.3g} req/s "
                                           f"(operating point {base.offered_rate:.3g}): {text}")


def _max_context(point: PointEval) -> int | None:
    lengths = [r.prompt_tokens + r.output_tokens for run in point.valid_runs for r in run.requests()]
    return max(lengths) if lengths else None


def _kv_point(configs: list[ConfigEval], subject: ConfigEval,
              planned: int | None) -> tuple[ConfigEval, PointEval, int | None] | None:
    """The subject's operating point, or (when its trace stays short of the planned context) the operating
    point of a configuration whose trace reaches it."""
    candidates = [subject] + [c for c in configs if c is not subject]
    for config in candidates:
        point = config.operating_point or next((p for p in config.points if p.valid_runs), None)
        if point is None:
            continue
        context = _max_context(point)
        if config is subject and (planned is None or (context or 0) >= planned):
            return config, point, context
        if config is not subject and planned is not None and (context or 0) >= planned:
            return config, point, context
    point = subject.operating_point or next((p for p in subject.points if p.valid_runs), None)
    return None if point is None else (subject, point, _max_context(point))


def kv_stability(configs: list[ConfigEval], subject: ConfigEval, planned: int | None) -> ChecklistItem:
    question = "Are preemptions and KV cache pressure stable at the planned context length?"
    found = _kv_point(configs, subject, planned)
    if found is None:
        return ChecklistItem(question, Answer.UNKNOWN, f"{subject.name}: no valid run")
    config, point, context = found
    runs = point.valid_runs
    preemptions = [r.metric("num_preemptions") for r in runs]
    kv_peaks = [r.metric("kv_cache_usage_max") for r in runs]
    if any(v is None for v in preemptions + kv_peaks):
        return ChecklistItem(question, Answer.UNKNOWN, f"{config.name}: server metrics not available")
    completed = sum(r.summary.completed for r in runs) or 1
    per_request = sum(p or 0.0 for p in preemptions) / completed
    peak = max(k or 0.0 for k in kv_peaks)
    stable = per_request <= PREEMPTIONS_PER_REQUEST_MAX and peak <= KV_PRESSURE_MAX
    reached = "unknown" if context is None else f"{context:,} tokens"
    evidence = (f"{config.name} at {point.offered_rate:.3g} req/s, longest request {reached}: preemptions "
                f"{[int(p or 0) for p in preemptions]} per repeat ({per_request:.3f}/request), KV usage peak {peak:.0%}")
    if planned is None:
        return ChecklistItem(question, Answer.YES if stable else Answer.NO,
                             evidence + " (no planned context length given: planned_context_len in the study)")
    if context is None or context < planned:
        return ChecklistItem(question, Answer.UNKNOWN if stable else Answer.NO,
                             evidence + f"; the planned {planned:,} tokens were not reached: add a variant whose "
                             "trace reaches them (a study variant may change `trace`)")
    return ChecklistItem(question, Answer.YES if stable else Answer.NO, evidence + f" (planned {planned:,})")


def reproducibility(config: ConfigEval, inputs: ChecklistInputs) -> ChecklistItem:
    question = "Is the result reproducible with the exact model revision and GPU configuration?"
    point = config.operating_point or next((p for p in config.points if p.valid_runs), None)
    parts, worst = [], 0.0
    runs = point.valid_runs if point is not None else []
    for metric in ("request_throughput", "p95_ttft_ms", "p95_e2el_ms"):
        values = [v for v in (r.metric(metric) for r in runs) if v is not None]
        if len(values) >= 2:
            median = sorted(values)[len(values) // 2]
            spread = (max(values) - min(values)) / abs(median) if median else 0.0
            worst = max(worst, spread)
            parts.append(f"{metric} {min(values):.4g}..{max(values):.4g} ({spread:.0%})")
    where = f"{config.name}, {len(runs)} valid repeat(s)" + (f" at {point.offered_rate:.3g} req/s" if point else "")
    evidence = where + (": " + ", ".join(parts) if parts else "")
    if inputs.fixed_differences:
        return ChecklistItem(question, Answer.NO, evidence + "; the fixed things differ: "
                             + "; ".join(d.describe() for d in inputs.fixed_differences))
    if len(runs) >= 2 and worst > REPRODUCIBLE_SPREAD:
        return ChecklistItem(question, Answer.NO, evidence + f"; repeats spread more than {REPRODUCIBLE_SPREAD:.0%}")
    if len(runs) < 2:
        return ChecklistItem(question, Answer.UNKNOWN, evidence + "; fewer than 2 valid repeats")
    if inputs.fixed_unknown:
        return ChecklistItem(question, Answer.UNKNOWN, evidence + "; the fixed things agree where recorded, but "
                             f"these are unknown: {', '.join(inputs.fixed_unknown)}")
    return ChecklistItem(question, Answer.YES, evidence + "; every fixed thing is recorded and identical")


def servers_needed(config: ConfigEval, main_rate: float | None) -> tuple[int, float, float] | None:
    """(whole servers serving the main rate at the operating point, the fraction of their capacity left
    unused, USD per hour for them; None without an operating point or a price). A server's hour is the
    cost's own (cost per accepted × steady accepted rate × 3600), so "cheapest" and "saving" rest on one cost."""
    op = config.operating_point
    hourly = None if op is None else op.cost.server_hour
    if op is None or hourly is None or not math.isfinite(op.offered_rate):
        return None
    servers = 1 if not main_rate or main_rate <= 0 else max(1, math.ceil(main_rate / op.offered_rate - 1e-9))
    used = 1.0 if not main_rate or main_rate <= 0 else main_rate / (servers * op.offered_rate)
    return servers, 1.0 - used, servers * hourly


def _retries(config: ConfigEval) -> str:
    op = config.operating_point
    logs = [log for r in (op.valid_runs if op else []) if (log := r.summary.retries) is not None]
    if not logs:
        return "retries off (--retry-503 N counts responses accepted after a 503)"
    retried = sum(log.num_retried_requests for log in logs)
    retries = sum(log.num_retries for log in logs)
    return f"{retried} request(s) accepted or failed after {retries} retr{'y' if retries == 1 else 'ies'} of a 503"


def _serving(config: ConfigEval, main_rate: float | None) -> str:
    found = servers_needed(config, main_rate)
    if found is None:
        return f"{config.name} cannot serve it (no operating point)"
    servers, unused, hourly = found
    return f"{config.name} {servers} server(s), {unused:.0%} of their capacity unused, ${hourly:.3g}/hour"


def cheaper(configs: list[ConfigEval], recommendation: Recommendation, main_rate: float | None) -> ChecklistItem:
    """Compares the one cost (cost.py) the table and the headline show; the servers the main rate needs are
    its unused capacity: a configuration that needs as many dollars per hour there saves nothing."""
    question = ("Is the cost per accepted response lower than the alternative's, after retries and the capacity "
                "left unused?")
    best = next((c for c in configs if c.name == recommendation.recommended), None)
    others = [c for c in configs if best is None or c.name != best.name]
    if best is None or best.cost is None or not others:
        return ChecklistItem(question, Answer.UNKNOWN, "no recommended configuration or no alternative")
    costs = "; ".join([f"{best.name} {cost_text(best)}, {_retries(best)}"] + [f"{o.name} {cost_text(o)}"
                                                                              for o in others if o.cost is not None])
    if recommendation.outcome is Outcome.TIE:  # with or without prices, a tie saves nothing
        return ChecklistItem(question, Answer.NO, costs + f" ({recommendation.confidence} a tie, not a saving)")
    if not recommendation.priced:
        return ChecklistItem(question, Answer.UNKNOWN, f"{costs}; not every configuration has a price "
                             "(price_per_gpu_hour in the study, --price-per-gpu-hour, or --price GPU=...), so there is no "
                             "cost to compare")
    at = f"serving {main_rate:.3g} req/s" if main_rate else "at the operating point (no main rate given)"
    evidence = f"{costs}; {at}: " + "; ".join(_serving(c, main_rate) for c in [best, *others])
    best_cost, best_hourly = best.cost_per_accepted or 0.0, (servers_needed(best, main_rate) or (0, 0.0, 0.0))[2]
    rivals = [(o.cost_per_accepted, servers_needed(o, main_rate)) for o in others if o.cost_per_accepted is not None]
    cheapest = all(cost > best_cost * (1.0 + 1e-9) for cost, _ in rivals if cost is not None)
    # without a main rate there are no servers to provision: the cost per accepted response alone decides
    saving = not main_rate or all(found[2] > best_hourly * (1.0 + 1e-9) for _, found in rivals if found is not None)
    if not cheapest:
        evidence += "; an alternative costs as little per accepted response"
    if not saving:
        evidence += (f"; no saving at the main rate: an alternative serves it for as little ({best.name}'s extra "
                     "capacity is headroom, not a lower cost)")
    return ChecklistItem(question, Answer.YES if cheapest and saving else Answer.NO, evidence)


def answer_checklist(configs: list[ConfigEval], recommendation: Recommendation,
                     inputs: ChecklistInputs) -> list[ChecklistItem]:
    """The five answers for the recommended configuration (else the first one measured)."""
    subject = next((c for c in configs if c.name == recommendation.recommended), configs[0] if configs else None)
    if subject is None:
        return []
    return [main_scenario(subject, inputs.main_rate), burst(subject),
            kv_stability(configs, subject, inputs.planned_context_len), reproducibility(subject, inputs),
            cheaper(configs, recommendation, inputs.main_rate)]
