"""Confidence intervals: coverage on synthetic data with known percentiles and rates, and the edge cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

from conveyor.bench.measure.intervals import (
    IntervalConfig,
    IntervalMethod,
    across_repeats,
    bucket_quantile,
    grouped_percentile_intervals,
    percentile_intervals,
    proportion_interval,
    ratio_interval,
)
from conveyor.bench.measure.run_stats import (
    RequestSample,
    completion_rate,
    pooled_intervals,
    rate_intervals,
    sample_intervals,
    steady_accepted_rate,
)

FAST = IntervalConfig(num_resamples=999)
SIGMA = 0.5  # lognormal(0, 0.5): p50 = 1, p95 = exp(0.5 * 1.645)
TRUE_P50, TRUE_P95 = 1.0, math.exp(SIGMA * 1.6448536269514722)


def _coverage(n: int, trials: int, q: float, truth: float) -> float:
    rng = np.random.default_rng(11)
    hits = 0
    for seed in range(trials):
        values = rng.lognormal(0.0, SIGMA, n)
        interval = percentile_intervals(values, [q], IntervalConfig(num_resamples=999, seed=seed))[0]
        hits += interval.low <= truth <= interval.high
    return hits / trials


def test_percentile_interval_covers_the_true_percentile() -> None:
    """Nominal 95%: the bootstrap of a p95 from 300 requests covers the true p95 about 93% of the time
    (measured 0.92-0.94 here; a bootstrap of a tail quantile under-covers a little), the median ~95%."""
    assert 0.88 <= _coverage(300, 120, 0.95, TRUE_P95) <= 1.0
    assert 0.90 <= _coverage(200, 120, 0.50, TRUE_P50) <= 1.0


def test_rate_interval_covers_a_poisson_rate() -> None:
    """Completions of a Poisson process at 4 req/s: gaps resampled, count / duration covers 4 req/s."""
    rng = np.random.default_rng(5)
    hits = 0
    for seed in range(150):
        gaps = rng.exponential(1 / 4.0, 200)
        interval = ratio_interval(np.ones(200), gaps, IntervalConfig(num_resamples=999, seed=seed))
        assert interval is not None and interval.estimate == pytest.approx(200 / gaps.sum())
        hits += interval.low <= 4.0 <= interval.high
    assert hits / 150 >= 0.88


def test_too_few_requests_give_no_upper_bound_on_a_tail() -> None:
    """12 requests: their p95 is nearly their maximum; nothing bounds the true p95 from above."""
    values = np.random.default_rng(0).lognormal(0, SIGMA, 12)
    p50, p95 = percentile_intervals(values, [0.5, 0.95], FAST)
    assert math.isinf(p95.high) and p95.low <= p95.estimate
    assert math.isfinite(p50.high) and p50.low <= p50.estimate <= p50.high
    assert percentile_intervals([], [0.95], FAST) == []


def test_identical_values_and_grouped_gaps() -> None:
    same = percentile_intervals([5.0] * 50, [0.95], FAST)[0]
    assert (same.low, same.estimate, same.high) == (5.0, 5.0, 5.0)
    rng = np.random.default_rng(2)
    groups = [list(rng.exponential(1.0, 20)) for _ in range(60)]
    p95 = grouped_percentile_intervals(groups, [0.95], FAST)[0]
    assert p95.low < p95.estimate < p95.high and p95.num_samples == 1200


def test_error_rate_is_exact_binomial() -> None:
    none = proportion_interval(0, 100, FAST)
    assert none is not None and none.low == 0.0 and none.high == pytest.approx(0.0362, abs=1e-3)
    assert none.method is IntervalMethod.CLOPPER_PEARSON
    assert proportion_interval(0, 0, FAST) is None


def test_repeats_widen_the_pooled_interval() -> None:
    pooled = percentile_intervals(np.linspace(90, 110, 200), [0.5], FAST)[0]
    wide = across_repeats(pooled, [80.0, 100.0, 125.0], FAST)
    assert wide is not None and wide.low <= 80.5 and wide.high >= 124.0 and wide.estimate == pooled.estimate
    assert across_repeats(pooled, [100.0], FAST) is pooled


def test_histogram_lowest_bucket_is_a_bound_not_a_number() -> None:
    """Every queue time under 300 ms: the p95 is '<= 300 ms', never an interpolated 285 ms."""
    lowest = bucket_quantile(0.95, [(0.3, 40.0), (0.5, 40.0), (math.inf, 40.0)], FAST)
    assert lowest is not None and lowest.interpolated is None
    assert (lowest.lower, lowest.upper, lowest.interval.low, lowest.interval.high) == (0.0, 0.3, 0.0, 0.3)
    inner = bucket_quantile(0.95, [(0.1, 10.0), (0.5, 90.0), (1.0, 100.0), (math.inf, 100.0)], FAST)
    assert inner is not None and inner.interpolated == pytest.approx(0.75)  # rank 95: halfway in (0.5, 1]
    assert inner.interval.low >= 0.1 and inner.interval.high <= 1.0
    assert bucket_quantile(0.95, [(0.1, 0.0), (math.inf, 0.0)], FAST) is None


def _run(num: int, seed: int, ttft_scale: float = 1.0) -> list[RequestSample]:
    rng = np.random.default_rng(seed)
    sent = np.cumsum(rng.exponential(0.5, num))
    out = []
    for i, t in enumerate(sent):
        ttft = float(rng.lognormal(-2, 0.3)) * ttft_scale
        e2e = ttft + 0.5
        out.append(RequestSample(status="failed" if i % 25 == 0 else "completed", sent_s=float(t),
                                 end_s=float(t + e2e), ttft_s=ttft, e2e_s=e2e, tpot_s=0.01,
                                 itl_s=(0.01, 0.02), output_tokens=10, request_class="chat", request_id=str(i)))
    return out


def test_run_and_pooled_intervals_use_summary_keys() -> None:
    one = sample_intervals(_run(100, 0), None, FAST)
    for key in ("p95_ttft_ms", "p99_e2el_ms", "median_itl_ms", "request_throughput", "output_throughput",
                "total_token_throughput", "error_rate"):
        assert key in one and one[key].low <= one[key].estimate <= one[key].high, key
    assert one["error_rate"].estimate == pytest.approx(4 / 100)
    pooled = pooled_intervals([_run(100, 0), _run(100, 1, ttft_scale=1.5)], None, FAST,
                              ["p95_ttft_ms", "request_throughput"])
    assert set(pooled) == {"p95_ttft_ms", "request_throughput"}
    assert pooled["p95_ttft_ms"].method is IntervalMethod.BOOTSTRAP_REPEATS
    # the second repeat is 1.5x slower: the pooled interval reaches both repeats' own p95s
    assert pooled["p95_ttft_ms"].high - pooled["p95_ttft_ms"].low > one["p95_ttft_ms"].high - one["p95_ttft_ms"].low


def test_per_class_intervals_cover_what_per_class_reports() -> None:
    from conveyor.bench.measure.run_stats import class_intervals

    samples = _run(60, 3)
    samples = [s if i % 3 else RequestSample(**{**s.__dict__, "request_class": "long"}) for i, s in enumerate(samples)]
    by_class = class_intervals(samples, FAST)
    assert set(by_class) == {"chat", "long"}
    assert {"p50_ttft_ms", "p99_e2el_ms", "p95_itl_ms", "error_rate", "request_throughput"} <= set(by_class["chat"])
    total = sample_intervals(samples, None, FAST)["request_throughput"].estimate
    assert sum(c["request_throughput"].estimate for c in by_class.values()) == pytest.approx(total)


def test_the_steady_completion_rate_leaves_out_the_time_to_fill_the_pipeline() -> None:
    """60 requests at 1 req/s, each answered in 20 s: vLLM's request_throughput counts the 20 s before the
    first answer (60 / 79 s); the steady rate sees the server keep up. A server whose answers come 1.5 s
    apart (E2E growing 0.5 s a request) shows ~0.67 req/s: it did not keep up."""
    cfg = IntervalConfig(num_resamples=300)
    kept_up = [RequestSample(status="completed", sent_s=float(i), end_s=i + 20.0, e2e_s=20.0) for i in range(60)]
    falling_behind = [RequestSample(status="completed", sent_s=float(i), end_s=20.0 + 1.5 * i, e2e_s=20.0 + 0.5 * i)
                      for i in range(200)]
    whole = rate_intervals([kept_up], None, cfg)
    assert whole["request_throughput"].estimate == pytest.approx(60 / 79)
    assert whole["completion_rate"].estimate == pytest.approx(1.0)
    assert whole["completion_rate"].method is IntervalMethod.POISSON
    behind = completion_rate([falling_behind], cfg)
    assert behind.estimate == pytest.approx(2 / 3, rel=0.05) and behind.high < 1.0
    assert completion_rate([[kept_up[0]]], cfg) is None  # one end: no rate between ends


def test_the_steady_completion_rate_is_not_biased_by_the_spread_of_answer_lengths() -> None:
    """A server that keeps up with 4 req/s, answers taking 3 s to 25 s: from the first end (a 3 s answer)
    to the last (a 25 s one) the ends span ~22 s more than the sends, which read as ~20% less rate. The
    steady window starts once the pipeline is full and ends at the last send."""
    e2e = [3.0 + 22.0 * ((7 * i) % 360) / 359 for i in range(360)]
    samples = [RequestSample(status="completed", sent_s=i / 4, end_s=i / 4 + e2e[i], e2e_s=e2e[i]) for i in range(360)]
    steady = completion_rate([samples], IntervalConfig(num_resamples=300))
    assert steady.estimate == pytest.approx(4.0, rel=0.05)
    assert steady.low < 4.0 <= steady.high


def test_no_steady_rate_when_the_pipeline_never_fills_before_the_sends_stop() -> None:
    burst = [RequestSample(status="completed", sent_s=0.01 * i, end_s=30.0 + i, e2e_s=30.0 + i) for i in range(40)]
    assert completion_rate([burst], IntervalConfig(num_resamples=300)) is None


def test_the_steady_accepted_rate_counts_accepted_ends_in_the_capacity_rules_window() -> None:
    """100 requests at 1 req/s answered in 10 s, every 4th too slow to first token: the window is [10, 99)
    (first send + p95 E2E to the last send), 89 ends there, 23 of them not accepted."""
    cfg = IntervalConfig(num_resamples=300)
    run = [RequestSample(status="completed", sent_s=float(i), end_s=i + 10.0, e2e_s=10.0,
                         ttft_s=2.0 if i % 4 == 0 else 0.2) for i in range(100)]
    accepted = steady_accepted_rate([run], lambda s: (s.ttft_s or 0.0) < 1.0, cfg)
    assert accepted is not None and accepted.estimate == pytest.approx(66 / 89)
    assert accepted.method is IntervalMethod.POISSON and accepted.low < accepted.estimate < accepted.high
    completed = steady_accepted_rate([run], None, cfg)  # no per-request bound: every completed response
    assert completed == completion_rate([run], cfg)
    assert rate_intervals([run], None, cfg)["steady_accepted_rate"] == completed
    burst = [RequestSample(status="completed", sent_s=0.01 * i, end_s=30.0 + i, e2e_s=30.0 + i) for i in range(40)]
    assert steady_accepted_rate([burst], None, cfg) is None  # the pipeline never filled


def test_garwood_interval_of_a_poisson_count() -> None:
    from conveyor.bench.measure.intervals import poisson_rate_interval

    interval = poisson_rate_interval(100, 50.0, IntervalConfig())
    assert interval.estimate == 2.0
    assert interval.low == pytest.approx(81.37 / 50, rel=1e-3) and interval.high == pytest.approx(121.63 / 50, rel=1e-3)
    assert poisson_rate_interval(0, 10.0, IntervalConfig()).low == 0.0
