"""The report's PNG plots (matplotlib, Agg backend: no display needed).

Four figures: completed vs offered rate per configuration (the y = x line is perfect service); p95
TTFT / queue time / E2E vs offered rate with the objective drawn as a dashed line; KV usage and waiting
requests over time for each configuration's operating point and first point not met; p95 TTFT and E2E
per request class at each configuration's operating point. Each marker is a point's estimate over its
valid repeats pooled, the error bar its confidence interval (an open triangle: no upper bound could be
established); a queue time in the histogram's lowest bucket is drawn at the bucket's bound with a
downward bar. Invalid runs are never drawn.
"""

from __future__ import annotations

import math
import pathlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import matplotlib.ticker as ticker  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from conveyor.bench.decide.decision import ConfigEval, PointEval  # noqa: E402
from conveyor.bench.decide.point_verdict import PointStatus, queue_interval  # noqa: E402
from conveyor.bench.decide.slo import SLO  # noqa: E402
from conveyor.bench.measure.intervals import Interval, IntervalConfig  # noqa: E402
from conveyor.bench.measure.rundirs import RunResult  # noqa: E402
from conveyor.bench.measure.summary import ClassSummary  # noqa: E402

_DPI = 110


def _interval(point: PointEval, metric: str) -> Interval | None:
    if metric.startswith("server."):
        return queue_interval(point.valid_runs, metric, IntervalConfig())[0]
    return point.intervals.get(metric)


@dataclass
class Series:
    """One configuration's markers and error bars for one metric."""

    xs: list[float] = field(default_factory=list)
    ys: list[float] = field(default_factory=list)
    below: list[float] = field(default_factory=list)
    above: list[float] = field(default_factory=list)
    unbounded: list[bool] = field(default_factory=list)


def series(config: ConfigEval, metric: str) -> Series:
    """Valid points only; an unbounded upper end gets no bar above and an open triangle."""
    out = Series()
    for point in config.points:
        iv = _interval(point, metric) if point.status is not PointStatus.INVALID else None
        if iv is None or not math.isfinite(point.offered_rate) or not math.isfinite(iv.estimate):
            continue
        out.xs.append(point.offered_rate)
        out.ys.append(iv.estimate)
        out.below.append(max(0.0, iv.estimate - iv.low))
        out.above.append(0.0 if math.isinf(iv.high) else max(0.0, iv.high - iv.estimate))
        out.unbounded.append(math.isinf(iv.high))
    return out


def _draw(ax: Axes, config: ConfigEval, metric: str) -> float:
    """Draw one configuration's series; returns its largest offered rate (0: nothing drawn)."""
    s = series(config, metric)
    if not s.xs:
        return 0.0
    line = ax.errorbar(s.xs, s.ys, yerr=[s.below, s.above], marker="o", capsize=3, label=config.name)
    open_x = [x for x, u in zip(s.xs, s.unbounded, strict=True) if u]
    open_y = [y for y, u in zip(s.ys, s.unbounded, strict=True) if u]
    if open_x:
        ax.plot(open_x, open_y, ls="none", marker="^", mfc="none", ms=10, color=line.lines[0].get_color())
    return max(s.xs)


def plot_throughput(configs: list[ConfigEval], path: pathlib.Path) -> pathlib.Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    top = max((_draw(ax, c, "request_throughput") for c in configs), default=0.0)
    if top:
        ax.plot([0, top], [0, top], ls=":", color="grey", label="completed = offered")
    ax.set(xlabel="offered rate (req/s)", ylabel="completed (req/s)",
           title="Completed vs offered load (bars: 95% interval)")
    ax.grid(alpha=0.3)
    _legend(ax)
    return _save(fig, path)


_LATENCY_PANELS = (("p95_ttft_ms", "ttft_p95_ms", "p95 TTFT (ms)"),
                   ("server.queue_time_p95_ms", "queue_p95_ms", "p95 queue time (ms)"),
                   ("p95_e2el_ms", "e2e_p95_ms", "p95 end-to-end (ms)"))


def plot_latency(configs: list[ConfigEval], slo: SLO, path: pathlib.Path) -> pathlib.Path:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (metric, bound_name, title) in zip(axes, _LATENCY_PANELS, strict=True):
        for config in configs:
            _draw(ax, config, metric)
        bound = getattr(slo, bound_name)
        if bound is not None:
            ax.axhline(bound, ls="--", color="red", label=f"objective {bound:g} ms")
        ax.set(xlabel="offered rate (req/s)", ylabel="ms", title=title)
        _log_axis_if_positive(ax)
        ax.grid(alpha=0.3)
        _legend(ax)
    fig.suptitle("p95 latency vs offered load (valid repeats pooled; bars: 95% interval)")
    return _save(fig, path)


def _log_axis_if_positive(ax: Axes) -> None:
    """Log y (a blow-up spans decades) with plain-number ticks at 1-2-5, when every value is > 0."""
    values = [y for line in ax.get_lines() for y in np.asarray(line.get_ydata(), dtype=float)]
    if not values or min(values) <= 0:
        return
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(ticker.NullFormatter())


def timeline_runs(configs: list[ConfigEval]) -> list[RunResult]:
    """Per configuration: the first valid repeat of its operating point and of its first point not met."""
    chosen: list[RunResult] = []
    for config in configs:
        for evaluated in (config.operating_point, config.first_failure()):
            if evaluated is not None and evaluated.valid_runs:
                chosen.append(evaluated.valid_runs[0])
    return chosen


def plot_timeseries(configs: list[ConfigEval], path: pathlib.Path) -> pathlib.Path:
    fig, (ax_kv, ax_wait) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    for run in timeline_runs(configs):
        samples = run.timeseries()
        if not samples:
            continue
        t = np.array([s.t_s for s in samples])
        kv = np.array([s.kv_cache_usage_perc or 0.0 for s in samples]) * 100.0
        waiting = np.array([s.num_requests_waiting or 0.0 for s in samples])
        label = f"{run.config_name} @ {run.offered_rate:.3g} req/s"
        ax_kv.plot(t - t[0], kv, label=label)
        ax_wait.plot(t - t[0], waiting, label=label)
    ax_kv.set(ylabel="KV cache usage (%)", title="KV usage and waiting requests over time")
    ax_wait.set(xlabel="time since first sample (s)", ylabel="waiting requests")
    for ax in (ax_kv, ax_wait):
        ax.grid(alpha=0.3)
        _legend(ax)
    return _save(fig, path)


def plot_per_class(configs: list[ConfigEval], path: pathlib.Path) -> pathlib.Path:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    chosen = [(c.name if c.operating_point else f"{c.name} (missed)",
               c.operating_point or (c.points[-1] if c.points else None)) for c in configs]
    runs = [(name, ev.valid_runs[0]) for name, ev in chosen if ev is not None and ev.valid_runs]
    classes = sorted({k for _, r in runs for k in r.summary.per_class})
    width = 0.8 / max(1, len(runs))
    for ax, metric in zip(axes, ("p95_ttft_ms", "p95_e2el_ms"), strict=True):
        for i, (name, run) in enumerate(runs):
            per_class = run.summary.per_class
            values = [(per_class[c].value(metric) or 0.0) if c in per_class else 0.0 for c in classes]
            errors = _class_errors(per_class, classes, metric, values)
            ax.bar(np.arange(len(classes)) + i * width, values, width, yerr=errors, capsize=3,
                   label=f"{name} @ {run.offered_rate:.3g}")
        ax.set_xticks(np.arange(len(classes)) + width * (len(runs) - 1) / 2, classes)
        ax.set(ylabel="ms", title=f"{metric} per request class (operating point; bars: 95% interval)")
        ax.grid(alpha=0.3, axis="y")
        _legend(ax)
    return _save(fig, path)


def _class_errors(per_class: Mapping[str, ClassSummary], classes: list[str], metric: str,
                  values: list[float]) -> list[list[float]]:
    """[below, above] error bars from each class's recorded interval (none above an unbounded one)."""
    below, above = [], []
    for name, value in zip(classes, values, strict=True):
        interval = per_class[name].ci.get(metric) if name in per_class else None
        below.append(0.0 if interval is None else max(0.0, value - interval.low))
        above.append(0.0 if interval is None or math.isinf(interval.high) else max(0.0, interval.high - value))
    return [below, above]


def _legend(ax: Axes) -> None:
    """A legend when something was drawn, else say that there was nothing to draw."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no data recorded", ha="center", va="center", transform=ax.transAxes, color="grey")


def _save(fig: Figure, path: pathlib.Path) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path
