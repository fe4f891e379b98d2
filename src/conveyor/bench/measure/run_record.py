"""What a run adds to summary.json for the decision: intervals, validity, fixed things, retries, client CPU.

runner.py measures; this module turns what it measured into the keys the decision reads (RUNDIR.md):
`ci` (an interval for every percentile and rate, run_stats.py), `per_class[c].ci`, `valid` /
`invalid_reason` / `invalid_reasons` (validity.py), `client_cpu_utilization`, `fixed` (fixed.py) and
`retries` (retry.py, when on). Kept apart from the runner so that the load side and the decision side
of the benchmark can change independently.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from conveyor.bench.jsonvalue import JSONObject
from conveyor.bench.load.client import RequestRecord
from conveyor.bench.load.retry import RetryLog, RetryPolicy
from conveyor.bench.measure.intervals import Interval, IntervalConfig
from conveyor.bench.measure.metrics import GoodputBounds, meets_bounds
from conveyor.bench.measure.run_stats import RequestSample, class_intervals, sample_intervals
from conveyor.bench.measure.summary import ClassSummary, RetrySummary, RunSummary, Validity
from conveyor.bench.measure.validity import ClientCpu, ValidityBounds, assess


@dataclass(frozen=True)
class RunContext:
    """What the runner measured besides the requests and the server's metrics."""

    client_cpu: ClientCpu | None = None
    """CPU the benchmark process used during the open loop."""
    fixed: JSONObject = field(default_factory=dict)
    """fixed.collect_fixed's record."""
    retry_policy: RetryPolicy | None = None
    """Retry policy in force (None: off)."""
    retry_log: RetryLog | None = None
    """What the retry middleware saw."""
    cache_salt: str | None = None
    """The cache_salt every request carried (None: a warm run, or none sent)."""
    num_warm_pass: int = 0
    """Requests the warm-up pass sent before the run (warm runs)."""


def with_run_record(summary: RunSummary, records: Sequence[RequestRecord], bounds: GoodputBounds | None,
                    validity_bounds: ValidityBounds, context: RunContext) -> RunSummary:
    """The summary with its intervals, validity, fixed things and retries added."""
    cfg = IntervalConfig()
    by_id = {r.request_id: r for r in records}

    def meets(sample: RequestSample) -> bool:
        return bounds is not None and sample.request_id in by_id and meets_bounds(by_id[sample.request_id], bounds)

    accept = meets if bounds is not None and not bounds.is_empty() else None
    samples = [RequestSample.from_json(r.to_json()) for r in records]
    return dataclasses.replace(
        summary, ci=sample_intervals(samples, accept, cfg), per_class=_with_class_intervals(summary, samples, cfg),
        validity=_validity(summary.validity, records, validity_bounds, context), fixed=context.fixed,
        retries=_retries(context.retry_policy, context.retry_log))


def _with_class_intervals(summary: RunSummary, samples: list[RequestSample],
                          cfg: IntervalConfig) -> dict[str, ClassSummary]:
    found: dict[str, dict[str, Interval]] = class_intervals(samples, cfg)
    return {name: dataclasses.replace(c, ci=found[name]) if name in found else c
            for name, c in summary.per_class.items()}


def _validity(load_side: Validity, records: Sequence[RequestRecord], bounds: ValidityBounds,
              context: RunContext) -> Validity:
    """The load side's verdict (send lag, an empty window) joined by the client's CPU and client-side errors."""
    prior = [load_side.invalid_reason] if not load_side.valid and load_side.invalid_reason else []
    verdict = assess(records, prior, context.client_cpu, bounds)
    return dataclasses.replace(load_side, valid=verdict.valid, invalid_reason=verdict.reason,
                               invalid_reasons=verdict.reasons,
                               client_cpu_utilization=verdict.client_cpu_utilization,
                               num_client_side_errors=verdict.num_client_side_errors)


def _retries(policy: RetryPolicy | None, log: RetryLog | None) -> RetrySummary | None:
    if policy is None or log is None:
        return None
    return RetrySummary(max_retries=policy.max_retries, num_retried_requests=log.num_retried_requests,
                        num_retries=log.num_retries, retry_wait_s=log.wait_s)
