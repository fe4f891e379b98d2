"""The verdict on one point (a configuration at one offered rate) from all its valid repeats.

The model: invalid runs (validity.py) are set aside: they are evidence of nothing. The valid repeats'
requests are pooled and every measurement the objective names gets one interval over requests and
repeats (run_stats.pooled_intervals; the server's queue-time buckets are summed over repeats first).
The point is met when every bound's interval lies under it and the server sustained the offered rate
(sustained.py: capacity is measured, not inferred), missed when one lies above, undecided when one
straddles its bound or the rate was not sustained, invalid when no repeat is valid. Runs recorded without requests.jsonl
fall back to their summary's values: one run's own interval, or the values bootstrapped over repeats.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence

from conveyor.bench.decide.slo import (
    SLO,
    SUMMARY_KEYS,
    BoundStatus,
    SLOVerdict,
    check_bound,
    summary_interval,
    summary_value,
)
from conveyor.bench.decide.sustained import not_sustained
from conveyor.bench.measure.intervals import Interval, IntervalConfig, across_repeats, bucket_quantile
from conveyor.bench.measure.run_stats import AcceptFn, RequestSample, pooled_intervals
from conveyor.bench.measure.rundirs import RunResult

RATE_KEYS = ("request_throughput", "goodput")


class PointStatus(enum.Enum):
    MET = "met"
    MISSED = "missed"
    UNDECIDED = "undecided"
    NO_DATA = "no_data"
    INVALID = "invalid"


def accept_fn(slo: SLO) -> AcceptFn | None:
    """A completed request is accepted when it meets every per-request bound (None: no bound set)."""
    bounds = slo.goodput_bounds()
    if not bounds:
        return None

    def accept(sample: RequestSample) -> bool:
        values = {"ttft_ms": sample.ttft_s, "tpot_ms": sample.tpot_s, "e2el_ms": sample.e2e_s}
        return all(values[k] is None or (values[k] or 0.0) * 1000.0 <= bound for k, bound in bounds.items())

    return accept


def valid_runs(runs: Sequence[RunResult]) -> list[RunResult]:
    return [r for r in runs if r.valid]


def _samples(run: RunResult) -> list[RequestSample] | None:
    rows = [row for row in run.requests() if row.in_window]  # warm-up / cool-down are not measured
    return rows or None


def _fallback(runs: Sequence[RunResult], key: str, cfg: IntervalConfig) -> Interval | None:
    """Without request records: the narrowest interval a run recorded (each is a valid interval on its own),
    widened by the values bootstrapped over repeats; the estimate is the repeats' mean."""
    values = [v for v in (summary_value(r.summary, key) for r in runs) if v is not None and math.isfinite(v)]
    recorded = [i for i in (summary_interval(r.summary, key) for r in runs) if i is not None]
    if not values:
        return min(recorded, key=lambda i: i.high - i.low) if recorded else None
    estimate = sum(values) / len(values)
    narrowest = min(recorded, key=lambda i: i.high - i.low) if recorded else Interval.exact(estimate)
    base = Interval(estimate, min(narrowest.low, estimate), max(narrowest.high, estimate), narrowest.confidence,
                    narrowest.method, narrowest.num_samples)
    return across_repeats(base, values, cfg) if len(values) > 1 else base


def queue_interval(runs: Sequence[RunResult], key: str,
                    cfg: IntervalConfig) -> tuple[Interval | None, float | None]:
    """Pooled queue-time percentile and its interpolated value (None in the lowest or +Inf bucket):
    the repeats' bucket deltas summed, then read as one histogram."""
    tables = [r.server.queue_time_buckets for r in runs]
    if len(runs) == 1 or not all(tables):
        return _fallback(runs, key, cfg), summary_value(runs[0].summary, key) if len(runs) == 1 else None
    summed: dict[float, float] = {}
    for table in tables:
        for bound, count in table:
            summed[bound] = summed.get(bound, 0.0) + count
    q = float(key.removeprefix("server.queue_time_p").removesuffix("_ms")) / 100.0
    found = bucket_quantile(q, sorted(summed.items()), cfg)
    if found is None:
        return None, None
    iv = found.interval
    interval = Interval(1000.0 * iv.estimate, 1000.0 * iv.low, 1000.0 * iv.high, iv.confidence, iv.method,
                        iv.num_samples)
    return interval, None if found.interpolated is None else 1000.0 * found.interpolated


def point_intervals(runs: Sequence[RunResult], slo: SLO, cfg: IntervalConfig) -> dict[str, Interval]:
    """Summary key -> pooled interval, for the client-side keys the objective names and the rates."""
    keys = [SUMMARY_KEYS[n] for n in SUMMARY_KEYS if getattr(slo, n) is not None]
    steady = ["completion_rate", "steady_offered_rate", "steady_accepted_rate"]
    client_keys = [k for k in keys if not k.startswith("server.")] + list(RATE_KEYS) + steady
    samples = [_samples(r) for r in runs]
    out: dict[str, Interval] = {}
    if runs and all(s is not None for s in samples):
        out.update(pooled_intervals([s or [] for s in samples], accept_fn(slo), cfg, client_keys))
    else:
        for key in client_keys:
            found = _fallback(runs, key, cfg)
            if found is not None:
                out[key] = found
    return out


def shown_slo(slo: SLO) -> SLO:
    """`slo` with the dashboard's keys (p95 TTFT, p95 ITL, p95 E2E, error rate) asked for too."""
    return dataclasses.replace(slo, **{k: 1.0 for k in ("ttft_p95_ms", "itl_p95_ms", "e2e_p95_ms", "error_rate")
                                       if getattr(slo, k) is None})


def point_verdict(runs: Sequence[RunResult], slo: SLO, cfg: IntervalConfig,
                  intervals: dict[str, Interval] | None = None) -> tuple[PointStatus, SLOVerdict]:
    """The point's status and its bound checks, over its valid repeats (`intervals`: point_intervals
    already computed for these runs, covering the objective's keys)."""
    valid = valid_runs(runs)
    if not valid:
        return PointStatus.INVALID, SLOVerdict(())
    intervals = point_intervals(valid, slo, cfg) if intervals is None else intervals
    checks = []
    for name, key in SUMMARY_KEYS.items():
        bound = getattr(slo, name)
        if bound is None:
            continue
        if key.startswith("server."):
            interval, measured = queue_interval(valid, key, cfg)  # measured None: "<= bucket bound"
        else:
            interval = intervals.get(key)
            measured = interval.estimate if interval is not None else None
        checks.append(check_bound(name, float(bound), measured, interval))
    verdict = SLOVerdict(tuple(checks))
    if verdict.passed:
        verdict = SLOVerdict(tuple(checks), not_sustained(valid, intervals))
    return PointStatus(verdict.status.value) if verdict.status is not BoundStatus.MET else PointStatus.MET, verdict
