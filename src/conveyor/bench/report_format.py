"""Numbers as a person reads them: units, sensible precision, intervals, "<= bound" for histogram buckets.

Latencies in ms with thousands separators (1,376 ms; 12.5 ms below 100), rates in req/s with three
significant digits, fractions as percentages, bytes in GiB/MiB; never scientific notation. An interval
is shown as `value [low, high]`; an unbounded upper end as "..."; a histogram percentile that fell in the
lowest bucket as "<= bound".
"""

from __future__ import annotations

import math
from typing import Any

from conveyor.bench.intervals import Interval, IntervalMethod
from conveyor.bench.slo import summary_interval, summary_value


def fmt_ms(value: float | None) -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return "unbounded"
    return f"{value:,.0f} ms" if abs(value) >= 100 else f"{value:.3g} ms"


def fmt_rate(value: float | None) -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return "inf"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def fmt_percent(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{100.0 * value:.3g}%"


def fmt_count(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def fmt_bytes(value: float | None) -> str:
    if value is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= size:
            return f"{value / size:.3g} {unit}"
    return f"{value:.0f} B"


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


def summary_cell(summary: dict[str, Any], key: str) -> str:
    """One summary.json key with its recorded interval ("server." keys from the server object)."""
    return fmt_interval(summary_value(summary, key), summary_interval(summary, key), unit_of(key.split(".")[-1]))
