"""Whether a point's server sustained its offered rate: capacity is measured, never inferred.

A point may meet every latency bound and still not show capacity: 40 requests sent at once finish
fast, yet the server completed them at a lower rate than offered, and a queue that grows through the
run would have broken the bounds had the run lasted longer. So a point counts as meeting the objective
at R req/s only when, over its valid repeats pooled,
  - the completed rate's interval reaches the rate its sends would complete at if kept up with -- the
    steady rate, the ends counted from the pipeline's fill (first send + p95 E2E) to the last send, against
    the ends expected there from the realized sends and the run's E2Es (run_stats.steady_rates), where the
    requests are recorded; else the completed rate against R -- and
  - the server's waiting requests did not grow over the steady-state window (the mean of the window's
    last third exceeds the first third's by at least `min_growth` requests and `relative_growth` of it)
    in most of the repeats that scraped enough samples; and when the server was scraped but no repeat's
    window held `min_samples` scrapes, the run was too short to show it (a burst of 40 requests at 18
    req/s lasts two seconds: that is not a rate the server sustains).
Otherwise its verdict is undecided (point_verdict.py), so the sweep repeats it. Over a concurrency
axis or a burst (no finite offered rate) only the waiting-growth rule applies. Runs recorded without a server
time series (another server, older runs) are judged on the completed rate alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from conveyor.bench.jsonvalue import Fields
from conveyor.bench.measure.intervals import Interval
from conveyor.bench.measure.rundirs import RunResult


@dataclass(frozen=True)
class SustainRule:
    """Thresholds of the waiting-growth test."""

    min_samples: int = 6
    """Fewest server scrapes inside the window for a trend (fewer: no evidence either way)."""
    min_growth: float = 2.0
    """Smallest rise, in waiting requests, that counts as growth (one or two is scrape noise)."""
    relative_growth: float = 0.5
    """Smallest rise relative to the first third's mean that counts as growth."""


def _window(run: RunResult) -> tuple[float, float]:
    """The steady-state window's sends, in seconds from the run's start (summary.json `window`); without
    one, the dispatch window num_prompts / rate (the drain after it is not steady state)."""
    window = Fields(run.summary.window, "summary.json: window")
    start, end = window.raw("start_s"), window.raw("end_s")
    if isinstance(start, int | float) and isinstance(end, int | float) and end > start:
        return float(start), float(end)
    rate = run.offered_rate
    dispatch = run.summary.num_prompts / rate if math.isfinite(rate) and rate > 0 else run.summary.duration
    return 0.0, dispatch


def _in_window(run: RunResult) -> list[float]:
    """Waiting requests at each server scrape inside the steady-state window."""
    start, end = _window(run)
    return [s.num_requests_waiting or 0.0 for s in run.timeseries() if start <= s.t_s <= end]


def waiting_trend(run: RunResult, rule: SustainRule = SustainRule()) -> tuple[float, float] | None:
    """Mean waiting requests in the first and the last third of the steady-state window (None: too few
    scrapes inside it)."""
    series = _in_window(run)
    if len(series) < rule.min_samples:
        return None
    third = len(series) // 3
    return sum(series[:third]) / third, sum(series[-third:]) / third


def grows(trend: tuple[float, float], rule: SustainRule = SustainRule()) -> bool:
    first, last = trend
    return last - first >= max(rule.min_growth, rule.relative_growth * first)


def not_sustained(runs: Sequence[RunResult], intervals: dict[str, Interval],
                  rule: SustainRule = SustainRule()) -> str | None:
    """Why these valid repeats of one point do not show the server sustaining its offered rate (None:
    they do, or nothing speaks against it)."""
    if not runs:
        return None
    rate = runs[0].offered_rate
    # The steady completion rate when the requests are at hand (older runs: the whole run's rate).
    completed = intervals.get("completion_rate") or intervals.get("request_throughput")
    # Against what the sends, as realized, would have completed at over the same window (else the nominal rate).
    realized = intervals.get("steady_offered_rate") if "completion_rate" in intervals else None
    offered = realized.estimate if realized is not None else rate
    if completed is not None and math.isfinite(rate) and completed.high < offered:
        what = f"the {offered:.3g} its sends would complete at" if realized is not None else f"the offered {rate:.3g}"
        return (f"not sustained: completed {completed.estimate:.3g} [{completed.low:.3g}, {completed.high:.3g}] "
                f"req/s, below {what}")
    trends = [t for t in (waiting_trend(r, rule) for r in runs) if t is not None]
    # Only an offered rate can be shown sustained: a closed loop (concurrency) holds its queue by design.
    if not trends and math.isfinite(rate) and any(r.timeseries() for r in runs):
        start, end = _window(runs[0])
        return (f"not shown sustained: the steady-state window ({end - start:.3g} s, {len(_in_window(runs[0]))} "
                f"server scrapes) is too short to show whether waiting grows ({rule.min_samples} scrapes needed): "
                "run more requests per run")
    growing = [t for t in trends if grows(t, rule)]
    if trends and 2 * len(growing) > len(trends):
        first, last = growing[0]
        return (f"not sustained: waiting grew from {first:.1f} to {last:.1f} requests over the steady-state window "
                f"in {len(growing)} of {len(trends)} repeat(s)")
    return None
