"""Confidence intervals for the numbers a decision rests on: percentiles, rates and proportions.

The model: a run is a sample of requests, so every percentile and rate it reports is an estimate. The
interval around it comes from resampling what was measured, with scipy (never hand-rolled):
- a percentile: scipy.stats.bootstrap (BCa; the percentile method when BCa degenerates) over the
  values; a pooled statistic such as ITL resamples *requests*, each with all its gaps;
- a rate (completed, output tokens, accepted per second): the run's request ends, each with the gap
  since the previous one, resampled in pairs; the statistic is Σ numerator / Σ gap, which is exactly
  count / duration on the original sample;
- a proportion (error rate): Clopper-Pearson from scipy.stats.binomtest: with no failure in n requests
  a bootstrap would say [0, 0], the exact interval says [0, 3.7/n].
Over several repeats of a point the interval is the hull of two: the pooled requests resampled within
each repeat (sampling noise) and the per-repeat values bootstrapped over repeats (disagreement between
runs). The hull is conservative; it narrows as repeats accumulate.
Too few values for a tail percentile (fewer than 2 / (1 − q), e.g. 40 for p95) give no upper bound: the
sample's largest value is then likely below the true percentile and no resampling can see past it.
Bootstraps are seeded, so the same data always give the same interval (and the same report).
"""

from __future__ import annotations

import enum
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray
from scipy import stats

from conveyor.bench.jsonvalue import JSON, Fields, JsonShapeError

FloatArray = NDArray[np.float64]


class IntervalMethod(enum.Enum):
    BOOTSTRAP_REQUESTS = "bootstrap over requests"
    BOOTSTRAP_REPEATS = "bootstrap over requests and repeats"
    CLOPPER_PEARSON = "Clopper-Pearson"
    POISSON = "exact Poisson (Garwood)"
    HISTOGRAM_BUCKET = "histogram bucket"
    NONE = "none"


@dataclass(frozen=True)
class IntervalConfig:
    """How intervals are computed."""

    confidence: float = 0.95
    """Confidence level of every interval."""
    num_resamples: int = 2000
    """Bootstrap resamples."""
    seed: int = 0
    """Bootstrap seed (same data, same interval)."""

    def __post_init__(self) -> None:
        if not 0.5 <= self.confidence < 1.0:
            raise ValueError(f"confidence must be in [0.5, 1), got {self.confidence}")
        if self.num_resamples < 100:
            raise ValueError(f"num_resamples must be >= 100, got {self.num_resamples}")


@dataclass(frozen=True)
class Interval:
    """An estimate and the interval around it (high = inf: no upper bound could be established)."""

    estimate: float
    """The point estimate (what the run reports)."""
    low: float
    """Lower end."""
    high: float
    """Upper end (math.inf when unbounded)."""
    confidence: float
    """Confidence level."""
    method: IntervalMethod
    """How it was computed."""
    num_samples: int
    """Values (or requests) it rests on."""

    def straddles(self, bound: float) -> bool:
        return self.low <= bound < self.high

    def overlaps(self, other: Interval) -> bool:
        return self.low < other.high and other.low < self.high

    def to_json(self) -> dict[str, Any]:
        return {"estimate": self.estimate, "low": self.low, "high": "inf" if math.isinf(self.high) else self.high,
                "confidence": self.confidence, "method": self.method.value, "n": self.num_samples}

    @classmethod
    def from_json(cls, data: JSON, where: str = "ci") -> Interval:
        f = Fields.of(data, where)
        if f.opt_number("estimate") is None or f.opt_number("low") is None:
            raise JsonShapeError(f"{where}: an interval needs an estimate and a low end")
        method = f.text("method", "none")
        if method not in {m.value for m in IntervalMethod}:
            raise JsonShapeError(f"{where}.method: {method!r} is not one of {[m.value for m in IntervalMethod]}")
        return cls(f.number("estimate"), f.number("low"), f.number("high", math.inf), f.number("confidence", 0.95),
                   IntervalMethod(method), f.integer("n"))

    @classmethod
    def exact(cls, value: float, num_samples: int = 1) -> Interval:
        """A value without an interval (e.g. a run recorded before intervals existed)."""
        return cls(value, value, value, 0.0, IntervalMethod.NONE, num_samples)


def min_samples_for(q: float) -> int:
    """Fewest values for which an upper bound of the q-quantile is given (p95: 40, p99: 200)."""
    return math.ceil(2.0 / (1.0 - q)) if q < 1.0 else 1 << 30


def _bootstrap(data: tuple[FloatArray, ...], statistic: Callable[..., Any], cfg: IntervalConfig,
               paired: bool = False, vectorized: bool = True) -> tuple[Any, Any]:
    """scipy's bootstrap, BCa first; the percentile method when BCa has no answer (degenerate data).
    Returns (low, high), scalars or arrays as the statistic; NaN where neither method gives one."""
    low: Any = math.nan
    high: Any = math.nan
    for method in ("BCa", "percentile"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # degenerate-data warnings: handled by the fallback
            result = stats.bootstrap(data, statistic, n_resamples=cfg.num_resamples, method=method,
                                     confidence_level=cfg.confidence, paired=paired, vectorized=vectorized,
                                     rng=np.random.default_rng(cfg.seed))
        low, high = result.confidence_interval.low, result.confidence_interval.high
        if np.all(np.isfinite(low)) and np.all(np.isfinite(high)):
            return low, high
    return low, high


def _clip(estimate: float, low: float, high: float) -> tuple[float, float]:
    """An interval always contains its estimate (BCa can drift off it on tiny or tied samples)."""
    if not math.isfinite(low) or not math.isfinite(high):
        return estimate, estimate
    return min(low, estimate), max(high, estimate)


def _percentile_result(estimates: FloatArray, lows: FloatArray, highs: FloatArray, qs: Sequence[float],
                       size: int, cfg: IntervalConfig) -> list[Interval]:
    out = []
    for q, estimate, low, high in zip(qs, estimates, lows, highs, strict=True):
        low, high = _clip(float(estimate), float(low), float(high))
        if size < min_samples_for(q):
            high = math.inf
        out.append(Interval(float(estimate), low, high, cfg.confidence, IntervalMethod.BOOTSTRAP_REQUESTS, size))
    return out


def percentile_intervals(values: Sequence[float], qs: Sequence[float], cfg: IntervalConfig) -> list[Interval]:
    """The q-quantiles (numpy's linear interpolation, as vLLM) of `values`, bootstrapped together."""
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        return []
    percents = [100.0 * q for q in qs]
    estimates = np.percentile(x, percents)
    if x.size < 2 or np.all(x == x[0]):
        lows, highs = estimates, estimates
    else:
        lows, highs = _bootstrap((x,), lambda a, axis: np.percentile(a, percents, axis=axis), cfg)
    return _percentile_result(estimates, lows, highs, qs, int(x.size), cfg)


def grouped_percentile_intervals(groups: Sequence[Sequence[float]], qs: Sequence[float],
                                 cfg: IntervalConfig) -> list[Interval]:
    """Quantiles of the pooled values of `groups` (each request's ITL gaps), resampling whole groups."""
    arrays = [np.asarray(g, dtype=float) for g in groups if len(g)]
    if not arrays:
        return []
    percents = [100.0 * q for q in qs]
    pooled = np.concatenate(arrays)
    estimates = np.percentile(pooled, percents)
    if len(arrays) < 2 or np.all(pooled == pooled[0]):
        lows, highs = estimates, estimates
    else:
        def statistic(index: FloatArray) -> FloatArray:
            return np.asarray(np.percentile(np.concatenate([arrays[int(i)] for i in index]), percents))

        indices = np.arange(len(arrays), dtype=float)
        lows, highs = _bootstrap((indices,), statistic, cfg, vectorized=False)
    return _percentile_result(estimates, lows, highs, qs, int(pooled.size), cfg)


def ratio_interval(numerators: Sequence[float], denominators: Sequence[float], cfg: IntervalConfig) -> Interval | None:
    """Σ numerators / Σ denominators over paired rows (a rate: per request end, its count and gap)."""
    num, den = np.asarray(numerators, dtype=float), np.asarray(denominators, dtype=float)
    if num.size == 0 or den.sum() <= 0:
        return None
    estimate = float(num.sum() / den.sum())
    if num.size < 2 or (np.all(num == num[0]) and np.all(den == den[0])):
        low, high = estimate, estimate
    else:
        def statistic(a: FloatArray, b: FloatArray, axis: int) -> FloatArray:
            total = b.sum(axis=axis)
            return np.asarray(a.sum(axis=axis) / np.where(total > 0, total, np.nan))

        low, high = _clip(estimate, *(float(v) for v in _bootstrap((num, den), statistic, cfg, paired=True)))
    return Interval(estimate, low, high, cfg.confidence, IntervalMethod.BOOTSTRAP_REQUESTS, int(num.size))


def proportion_interval(num_events: int, num_trials: int, cfg: IntervalConfig) -> Interval | None:
    """Clopper-Pearson interval of num_events / num_trials."""
    if num_trials <= 0:
        return None
    ci = stats.binomtest(num_events, num_trials).proportion_ci(confidence_level=cfg.confidence, method="exact")
    return Interval(num_events / num_trials, float(ci.low), float(ci.high), cfg.confidence,
                    IntervalMethod.CLOPPER_PEARSON, num_trials)


def poisson_rate_interval(num_events: int, exposure_s: float, cfg: IntervalConfig) -> Interval | None:
    """Garwood's exact interval of a Poisson rate: num_events counted over exposure_s seconds."""
    if exposure_s <= 0:
        return None
    alpha = 1.0 - cfg.confidence
    low = 0.0 if num_events == 0 else float(stats.chi2.ppf(alpha / 2, 2 * num_events)) / 2
    high = float(stats.chi2.ppf(1 - alpha / 2, 2 * num_events + 2)) / 2
    return Interval(num_events / exposure_s, low / exposure_s, high / exposure_s, cfg.confidence,
                    IntervalMethod.POISSON, num_events)


def across_repeats(pooled: Interval | None, per_repeat: Sequence[float], cfg: IntervalConfig) -> Interval | None:
    """Widen a pooled interval to the per-repeat values bootstrapped over repeats (their mean)."""
    values = np.asarray([v for v in per_repeat if math.isfinite(v)], dtype=float)
    if values.size < 2:
        return pooled
    if np.all(values == values[0]):
        low, high = float(values[0]), float(values[0])
    else:
        low, high = (float(v) for v in _bootstrap((values,), lambda a, axis: np.mean(a, axis=axis), cfg))
        if not (math.isfinite(low) and math.isfinite(high)):
            low, high = float(values.min()), float(values.max())
    if pooled is None:
        estimate = float(np.mean(values))
        return Interval(estimate, min(low, estimate), max(high, estimate), cfg.confidence,
                        IntervalMethod.BOOTSTRAP_REPEATS, int(values.size))
    return Interval(pooled.estimate, min(pooled.low, low), max(pooled.high, high), cfg.confidence,
                    IntervalMethod.BOOTSTRAP_REPEATS, pooled.num_samples)


@dataclass(frozen=True)
class BucketQuantile:
    """A quantile read from a cumulative histogram: the bucket holding it, and the interval over requests."""

    lower: float
    """Lower edge of the bucket holding the quantile (0 for the lowest bucket)."""
    upper: float
    """Upper edge (the bucket's `le`; inf for the +Inf bucket)."""
    interpolated: float | None
    """Prometheus' linear interpolation inside the bucket; None in the lowest bucket, where it would only
    restate the bucket's width (reported as "<= upper" instead)."""
    interval: Interval
    """From the lower edge of the bucket the 2.5% resample falls in to the upper edge of the 97.5% one."""


def bucket_quantile(q: float, buckets: Sequence[tuple[float, float]], cfg: IntervalConfig) -> BucketQuantile | None:
    """The q-quantile of a cumulative histogram [(le, count)] ending with +Inf; None without observations.
    Each observation is one request, so the interval resamples requests (their bucket indices)."""
    if len(buckets) < 2 or not math.isinf(buckets[-1][0]) or buckets[-1][1] <= 0:
        return None
    edges = [0.0] + [le for le, _ in buckets]
    counts = np.diff([0.0] + [c for _, c in buckets]).clip(min=0).round().astype(int)
    index = np.repeat(np.arange(len(counts), dtype=float), counts)
    if index.size == 0:
        return None

    def bucket_at(a: FloatArray, axis: int) -> FloatArray:
        return np.asarray(np.percentile(a, 100.0 * q, axis=axis, method="inverted_cdf"))

    b = int(bucket_at(index, 0))
    if index.size < 2 or np.all(index == index[0]):
        low_b, high_b = b, b
    else:
        low, high = _bootstrap((index,), bucket_at, _few_resamples(cfg), vectorized=True)
        low_b = b if not math.isfinite(float(low)) else min(b, int(math.floor(float(low))))
        high_b = b if not math.isfinite(float(high)) else max(b, int(math.ceil(float(high))))
    lower, upper = edges[b], edges[b + 1]
    interpolated = _interpolate(q, buckets, b) if b > 0 and math.isfinite(upper) else None
    estimate = interpolated if interpolated is not None else upper
    interval = Interval(estimate, edges[low_b], edges[high_b + 1], cfg.confidence, IntervalMethod.HISTOGRAM_BUCKET,
                        int(index.size))
    return BucketQuantile(lower, upper, interpolated, interval)


def _few_resamples(cfg: IntervalConfig) -> IntervalConfig:
    """Bucket indices are few distinct integers: the same settings, fewer resamples are plenty."""
    return IntervalConfig(cfg.confidence, min(cfg.num_resamples, 1000), cfg.seed)


def _interpolate(q: float, buckets: Sequence[tuple[float, float]], b: int) -> float:
    start, end = buckets[b - 1][0], buckets[b][0]
    below, count = buckets[b - 1][1], buckets[b][1] - buckets[b - 1][1]
    rank = q * buckets[-1][1] - below
    return start + (end - start) * (rank / count) if count > 0 else end
