"""Numbers as a person reads them: units and sensible precision, never scientific notation.

Latencies in ms with thousands separators (1,376 ms; 12.5 ms below 100), rates in req/s with three
significant digits, fractions as percentages, bytes in GiB/MiB. Every stage prints numbers (the runner's
console line, the report's tables), so this lives at the root of bench/.
"""

from __future__ import annotations

import math


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
