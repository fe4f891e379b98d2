"""Intervals as a person reads them, on top of units.py's numbers.

An interval is shown as `value [low, high]`; an unbounded upper end as "..."; a histogram percentile
that fell in the lowest bucket as "<= bound".
"""

from __future__ import annotations

import math

from conveyor.bench.decide.slo import summary_interval, summary_value
from conveyor.bench.measure.intervals import Interval, IntervalMethod
from conveyor.bench.measure.summary import ClassSummary, RunSummary
from conveyor.bench.units import fmt_ms, fmt_percent, fmt_rate

_FORMATTERS = {"ms": fmt_ms, "rate": fmt_rate, "percent": fmt_percent}


def unit_of(key: str) -> str:
    if key.endswith("_ms"):
        return "ms"
    if key in ("error_rate",):
        return "percent"
    return "rate"


def fmt_interval(value: float | None, interval: Interval | None, unit: str) -> str:
    """`value [low, high]`; `<= bound` for a lowest histogram bucket; just the value without an interval."""
    fmt = _FORMATTERS[unit]
    if interval is not None and value is None and interval.method is IntervalMethod.HISTOGRAM_BUCKET:
        return f"<= {fmt(interval.high)}" if interval.low == 0 else f"{fmt(interval.low)}..{fmt(interval.high)}"
    if value is None:
        return "-"
    if interval is None or interval.method is IntervalMethod.NONE:
        return fmt(value)
    high = "..." if math.isinf(interval.high) else fmt(interval.high)
    if unit == "ms":  # one unit for the three numbers
        return f"{fmt(value)} [{fmt(interval.low).removesuffix(' ms')}, {high.removesuffix(' ms')}]"
    return f"{fmt(value)} [{fmt(interval.low)}, {high}]"


def summary_cell(summary: RunSummary, key: str) -> str:
    """One summary.json key with its recorded interval ("server." keys from the server object)."""
    return fmt_interval(summary_value(summary, key), summary_interval(summary, key), unit_of(key.split(".")[-1]))


def class_cell(summary: ClassSummary, key: str) -> str:
    """One key of a class's summary with its recorded interval."""
    return fmt_interval(summary.value(key), summary.ci.get(key), unit_of(key))
