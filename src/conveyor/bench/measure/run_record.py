"""What a run adds to summary.json for the decision: intervals, validity, fixed things, retries, client CPU.

runner.py measures; this module turns what it measured into the keys the decision reads (RUNDIR.md):
`ci` (an interval for every percentile and rate, run_stats.py), `per_class[c].ci`, `valid` /
`invalid_reason` / `invalid_reasons` (validity.py), `client_cpu_utilization`, `fixed` (fixed.py) and
`retries` (retry.py, when on). Kept apart from the runner so that the load side and the decision side
of the benchmark can change independently.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from conveyor.bench.load.client import RequestRecord
from conveyor.bench.load.retry import RetryLog, RetryPolicy
from conveyor.bench.measure.intervals import IntervalConfig
from conveyor.bench.measure.metrics import GoodputBounds, meets_bounds
from conveyor.bench.measure.run_stats import RequestSample, class_intervals, sample_intervals
from conveyor.bench.measure.validity import ClientCpu, ValidityBounds, assess


@dataclass(frozen=True)
class RunContext:
    """What the runner measured besides the requests and the server's metrics."""

    client_cpu: ClientCpu | None = None
    """CPU the benchmark process used during the open loop."""
    fixed: dict[str, Any] = field(default_factory=dict)
    """fixed.collect_fixed's record."""
    retry_policy: RetryPolicy | None = None
    """Retry policy in force (None: off)."""
    retry_log: RetryLog | None = None
    """What the retry middleware saw."""
    cache_salt: str | None = None
    """The cache_salt every request carried (None: a warm run, or none sent)."""
    num_warm_pass: int = 0
    """Requests the warm-up pass sent before the run (warm runs)."""


def extend_summary(summary: dict[str, Any], records: Sequence[RequestRecord], bounds: GoodputBounds | None,
                   validity_bounds: ValidityBounds, context: RunContext) -> None:
    """Add intervals, validity, fixed things and retries to a run's summary (in place)."""
    cfg = IntervalConfig()
    by_id = {r.request_id: r for r in records}

    def meets(sample: RequestSample) -> bool:
        return bounds is not None and sample.request_id in by_id and meets_bounds(by_id[sample.request_id], bounds)

    accept = meets if bounds is not None and not bounds.is_empty() else None
    samples = [RequestSample.from_json(r.to_json()) for r in records]
    summary["ci"] = {k: v.to_json() for k, v in sample_intervals(samples, accept, cfg).items()}
    for name, intervals in class_intervals(samples, cfg).items():
        if name in summary.get("per_class", {}):
            summary["per_class"][name]["ci"] = {k: v.to_json() for k, v in intervals.items()}
    prior = [str(summary["invalid_reason"])] if summary.get("valid") is False and summary.get("invalid_reason") else []
    verdict = assess(records, prior, context.client_cpu, validity_bounds)
    summary.update(valid=verdict.valid, invalid_reason=verdict.reason, invalid_reasons=list(verdict.reasons),
                   client_cpu_utilization=verdict.client_cpu_utilization,
                   num_client_side_errors=verdict.num_client_side_errors, fixed=context.fixed)
    if context.retry_policy is not None and context.retry_log is not None:
        summary["retries"] = context.retry_log.summary(context.retry_policy)
