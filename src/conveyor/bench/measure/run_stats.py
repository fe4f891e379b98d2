"""Intervals for a run's summary keys, from its requests; pooled over the repeats of a point.

The model: a `RequestSample` is what one request contributes (its latencies, its outcome, when it
ended). From a run's samples come the intervals of every percentile and rate that summary.json
reports, under the same keys (`p95_ttft_ms`, `request_throughput`, `error_rate`, ...; see
intervals.py for the methods). From the samples of several repeats come pooled intervals: the pooled
requests resampled, widened by the per-repeat values bootstrapped over repeats. Latencies are in ms
as in summary.json. A rate's rows are the request ends in time order, each with the gap since the
previous end (the first since the first dispatch), so Σ gaps is the run's duration.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from conveyor.bench.jsonvalue import JSON, Fields
from conveyor.bench.measure.intervals import (
    Interval,
    IntervalConfig,
    IntervalMethod,
    across_repeats,
    grouped_percentile_intervals,
    percentile_intervals,
    poisson_rate_interval,
    proportion_interval,
    ratio_interval,
)

PERCENTILES = (50, 90, 95, 99)
LATENCY_KEYS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class RequestSample:
    """One request's contribution (seconds, as requests.jsonl)."""

    status: str
    """completed | failed | cancelled."""
    sent_s: float
    """Dispatch time from the run start."""
    end_s: float | None
    """End time from the run start."""
    ttft_s: float | None = None
    """Time to first token."""
    tpot_s: float | None = None
    """Time per output token."""
    e2e_s: float | None = None
    """End-to-end latency."""
    itl_s: tuple[float, ...] = field(default_factory=tuple)
    """Inter-token gaps."""
    output_tokens: int = 0
    """Output tokens."""
    prompt_tokens: int = 0
    """Prompt tokens."""
    request_class: str = ""
    """Trace class."""
    request_id: str = ""
    """The trace's request id."""
    in_window: bool = True
    """Inside the steady-state window (warm-up and cool-down requests are not measured)."""
    error_message: str | None = None
    """Why it failed, as the client saw it."""

    @classmethod
    def from_json(cls, row: JSON, where: str = "requests.jsonl") -> RequestSample:
        """From a requests.jsonl row (or RequestRecord.to_json())."""
        f = Fields.of(row, where)
        return cls(status=f.text("status", "None"), sent_s=f.number("sent_s"), end_s=f.opt_number("end_s"),
                   ttft_s=f.opt_number("ttft_s"), tpot_s=f.opt_number("tpot_s"), e2e_s=f.opt_number("e2e_s"),
                   itl_s=f.number_list("itl_s"), output_tokens=f.integer("output_tokens"),
                   prompt_tokens=f.integer("prompt_tokens"), request_class=f.text("request_class"),
                   request_id=f.text("request_id"), in_window=f.flag("in_window", True),
                   error_message=f.opt_text("error_message"))

    @property
    def completed(self) -> bool:
        return self.status == "completed"


AcceptFn = Callable[[RequestSample], bool]
"""Whether a completed request met every per-request bound (goodput)."""


def _latencies(samples: Sequence[RequestSample], key: str) -> list[float]:
    values = (getattr(s, f"{'e2e' if key == 'e2el' else key}_s") for s in samples if s.completed)
    return [1000.0 * v for v in values if v is not None]


def _percentile_keys(name: str, intervals: list[Interval]) -> dict[str, Interval]:
    out = {f"p{p}_{name}_ms": i for p, i in zip(PERCENTILES, intervals)}  # [] without data
    if intervals:
        out[f"median_{name}_ms"] = intervals[0]
    return out


def _rate_rows(samples: Sequence[RequestSample]) -> list[tuple[float, RequestSample]]:
    ended = sorted((s for s in samples if s.end_s is not None), key=lambda s: s.end_s or 0.0)
    if not ended:
        return []
    previous = min(s.sent_s for s in samples)
    rows = []
    for s in ended:
        rows.append((max(0.0, (s.end_s or 0.0) - previous), s))
        previous = s.end_s or previous
    return rows


def rate_intervals(repeats: Sequence[Sequence[RequestSample]], accept: AcceptFn | None,
                   cfg: IntervalConfig) -> dict[str, Interval]:
    """Rates and the error rate over one or more runs (each run's gaps start at its own first dispatch)."""
    rows = [row for samples in repeats for row in _rate_rows(samples)]
    gaps = [gap for gap, _ in rows]
    columns = {"request_throughput": [float(s.completed) for _, s in rows],
               "output_throughput": [float(s.output_tokens if s.completed else 0) for _, s in rows],
               "total_token_throughput": [float(s.output_tokens + s.prompt_tokens if s.completed else 0)
                                          for _, s in rows]}
    if accept is not None:
        columns["goodput"] = [float(s.completed and accept(s)) for _, s in rows]
    out = {}
    for key, numerators in columns.items():
        interval = ratio_interval(numerators, gaps, cfg)
        if interval is not None:
            out[key] = interval
    steady = steady_rates(repeats, cfg)
    if steady is not None:
        rate, offered = steady
        out["completion_rate"] = rate
        # A point value, not an estimate with an interval: what the sends would complete at if kept up with.
        out["steady_offered_rate"] = Interval(offered, offered, offered, cfg.confidence, IntervalMethod.NONE,
                                              rate.num_samples)
    accepted = steady_accepted_rate(repeats, accept, cfg)
    if accepted is not None:
        out["steady_accepted_rate"] = accepted
    counted = [s for samples in repeats for s in samples if s.status != "cancelled"]
    error = proportion_interval(sum(s.status == "failed" for s in counted), len(counted), cfg)
    if error is not None:
        out["error_rate"] = error
    return out


FILL_QUANTILE = 0.95
"""The pipeline counts as full this quantile of E2E after the first dispatch: from then on, of what was
sent one E2E earlier at least this share has ended, so a server that keeps up with R completes >= 0.95 R."""


def steady_window(samples: Sequence[RequestSample]) -> tuple[float, float] | None:
    """From the time the pipeline is full (first dispatch + p95 E2E of the completed requests) to the
    last dispatch: the stretch where a server that keeps up ends requests as fast as they are sent
    (None: no completed request, or the pipeline never filled before the sends stopped)."""
    e2e = sorted(s.e2e_s for s in samples if s.completed and s.e2e_s is not None)
    if not e2e:
        return None
    start = min(s.sent_s for s in samples) + e2e[min(len(e2e) - 1, int(FILL_QUANTILE * len(e2e)))]
    end = max(s.sent_s for s in samples)
    return (start, end) if end > start else None


def _expected_ends(samples: Sequence[RequestSample], start: float, end: float) -> float:
    """Ends expected inside [start, end) had the completed requests' E2Es not depended on when they were
    sent: Σ over sends of P(send + E2E in the window), E2E drawn from the run's own (a convolution). A
    server that falls behind ends fewer: its late sends take longer than the pooled E2Es say."""
    done = [s for s in samples if s.completed and s.e2e_s is not None]
    e2e = sorted(s.e2e_s or 0.0 for s in done)

    def share_within(t: float) -> float:  # empirical P(E2E < t)
        return bisect.bisect_left(e2e, t) / len(e2e)

    return sum(share_within(end - s.sent_s) - share_within(start - s.sent_s) for s in done)


def _steady_ends(samples: Sequence[RequestSample], window: tuple[float, float],
                 counted: Callable[[RequestSample], bool]) -> int:
    start, end = window
    return sum(1 for s in samples if s.completed and s.end_s is not None and start <= s.end_s < end and counted(s))


def steady_rates(repeats: Sequence[Sequence[RequestSample]], cfg: IntervalConfig) -> tuple[Interval, float] | None:
    """Completions per second inside each run's steady window, pooled (the requests that end there over the
    window's length), with Garwood's exact Poisson interval; and the rate its sends would have completed at
    (_expected_ends over the same windows) -- what the server was offered, as realized: a seeded Poisson
    schedule of 360 requests at a nominal 4 req/s spans 99.6 s, not 90. vLLM's request_throughput divides
    by the whole run, whose first stretch fills the pipeline (one E2E, 20 s for a 400-token answer on a 32B
    model) and whose last drains it. Counting from the first end to the last is biased too: the first end
    is the shortest answer's and the last the longest's (~20 s of spread on the GPU study: ~20% less)."""
    count, expected, span = 0, 0.0, 0.0
    for samples in repeats:
        window = steady_window(samples)
        if window is None:
            continue
        count += _steady_ends(samples, window, lambda _: True)
        expected += _expected_ends(samples, *window)
        span += window[1] - window[0]
    interval = poisson_rate_interval(count, span, cfg) if count >= 2 else None
    return None if interval is None else (interval, expected / span)


def steady_accepted_rate(repeats: Sequence[Sequence[RequestSample]], accept: AcceptFn | None,
                         cfg: IntervalConfig) -> Interval | None:
    """Accepted responses (completed, and meeting `accept` when given) per second in the same steady windows
    as steady_rates, pooled, with Garwood's interval: what a server kept at this load delivers. The cost per
    accepted response divides the price by it (decide/cost.py): the fill and the drain of a run are not
    what a steadily loaded server pays for. None: no run has a steady window, or fewer than 2 ends in it."""
    count, span = 0, 0.0
    for samples in repeats:
        window = steady_window(samples)
        if window is not None:
            count += _steady_ends(samples, window, accept or (lambda _: True))
            span += window[1] - window[0]
    return poisson_rate_interval(count, span, cfg) if count >= 2 and span > 0 else None


def completion_rate(repeats: Sequence[Sequence[RequestSample]], cfg: IntervalConfig) -> Interval | None:
    """The steady completion rate alone (steady_rates)."""
    rates = steady_rates(repeats, cfg)
    return None if rates is None else rates[0]


def sample_intervals(samples: Sequence[RequestSample], accept: AcceptFn | None,
                     cfg: IntervalConfig) -> dict[str, Interval]:
    """Intervals for every percentile and rate summary.json reports about one run's requests."""
    return _intervals([samples], accept, cfg, None)


def _intervals(repeats: Sequence[Sequence[RequestSample]], accept: AcceptFn | None,
               cfg: IntervalConfig, keys: Sequence[str] | None) -> dict[str, Interval]:
    """Every key (keys None), else only the latency families some key names (e.g. p95_ttft_ms)."""
    samples = [s for r in repeats for s in r]
    qs = [p / 100.0 for p in PERCENTILES]

    def wanted(name: str) -> bool:
        return keys is None or any(k.endswith(f"_{name}_ms") for k in keys)

    out: dict[str, Interval] = {}
    for name in (n for n in LATENCY_KEYS if wanted(n)):
        out.update(_percentile_keys(name, percentile_intervals(_latencies(samples, name), qs, cfg)))
    if wanted("itl"):
        gaps = [[1000.0 * g for g in s.itl_s] for s in samples if s.completed]
        out.update(_percentile_keys("itl", grouped_percentile_intervals(gaps, qs, cfg)))
    out.update(rate_intervals(repeats, accept, cfg))
    return out


def class_intervals(samples: Sequence[RequestSample], cfg: IntervalConfig) -> dict[str, dict[str, Interval]]:
    """Per request class, the keys summary.json's per_class reports: p50/p95/p99 TTFT and E2E, p50/p95 ITL,
    the error rate, and completed and output throughput over the whole run's duration (so they add up)."""
    rows = _rate_rows(samples)
    gaps = [gap for gap, _ in rows]
    out: dict[str, dict[str, Interval]] = {}
    for name in sorted({s.request_class for s in samples}):
        members = [s for s in samples if s.request_class == name]
        entry: dict[str, Interval] = {}
        for key in ("ttft", "e2el"):
            found = percentile_intervals(_latencies(members, key), [0.5, 0.95, 0.99], cfg)
            entry.update({f"p{p}_{key}_ms": i for p, i in zip((50, 95, 99), found)})
        itl = grouped_percentile_intervals([[1000.0 * g for g in s.itl_s] for s in members if s.completed],
                                           [0.5, 0.95], cfg)
        entry.update({f"p{p}_itl_ms": i for p, i in zip((50, 95), itl)})
        mine = [s.request_class == name for _, s in rows]
        for key, numerators in (("request_throughput", [float(m and s.completed) for m, (_, s) in zip(mine, rows)]),
                                ("output_throughput", [float(s.output_tokens) if m and s.completed else 0.0
                                                       for m, (_, s) in zip(mine, rows)])):
            found_rate = ratio_interval(numerators, gaps, cfg)
            if found_rate is not None:
                entry[key] = found_rate
        counted = [s for s in members if s.status != "cancelled"]
        error = proportion_interval(sum(s.status == "failed" for s in counted), len(counted), cfg)
        if error is not None:
            entry["error_rate"] = error
        out[name] = entry
    return out


def pooled_intervals(repeats: Sequence[Sequence[RequestSample]], accept: AcceptFn | None,
                     cfg: IntervalConfig, keys: Sequence[str]) -> dict[str, Interval]:
    """`keys` over several repeats: all their requests pooled, widened by the spread between repeats.
    Rates pool as Σ counts / Σ durations (each repeat's gaps start at its own first dispatch)."""
    per_repeat = [_intervals([r], accept, cfg, keys) for r in repeats] if len(repeats) > 1 else []
    pooled = _intervals(repeats, accept, cfg, keys)
    out = {}
    for key in keys:
        values = [r[key].estimate for r in per_repeat if key in r]
        interval = across_repeats(pooled.get(key), values, cfg)
        if interval is not None:
            out[key] = interval
    return out
