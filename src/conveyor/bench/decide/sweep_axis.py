"""What a sweep varies, and how its search moves along it: the offered rate, or a closed loop's concurrency.

The search (sweep.py) is the same on both axes: grow by a factor until a point is missed, then bisect
the bracket at its geometric midpoint. Only the values differ. A rate is any positive real, so a step
is value x factor (capped) and a midpoint is sqrt(good x bad). A concurrency level is a whole number
>= 1 (vLLM's --max-concurrency), so a step is rounded and always moves to a new level, and bisection
stops once no whole number lies strictly inside the bracket. Run directories and progress lines name
the axis (`rate-<r>-rep<k>` / `concurrency-<n>-rep<k>`; `req/s` / `concurrent`).
"""

from __future__ import annotations

import enum
import math


class SweepAxis(str, enum.Enum):
    """What the search varies: the offered rate (req/s), or the concurrency cap of a closed loop (an integer,
    vLLM's --max-concurrency; each run sends as slots free up). Everything else about the search is the same."""

    RATE = "rate"
    CONCURRENCY = "concurrency"


def run_dir_name(axis: SweepAxis, value: float, repeat: int) -> str:
    """`rate-<r>-rep<k>`, or `concurrency-<n>-rep<k>` over concurrency."""
    return f"rate-{value:.4g}-rep{repeat}" if axis is SweepAxis.RATE else f"concurrency-{value:g}-rep{repeat}"


def axis_unit(axis: SweepAxis) -> str:
    return "req/s" if axis is SweepAxis.RATE else "concurrent"


def _capped(value: float, max_value: float | None) -> float:
    return value if max_value is None else min(value, max_value)


def first_value(axis: SweepAxis, start: float, max_value: float | None) -> float:
    """The first point: `start` (rounded over concurrency), never above `max_value`."""
    return _capped(start if axis is SweepAxis.RATE else float(round(start)), max_value)


def next_value(axis: SweepAxis, value: float, factor: float, max_value: float | None) -> float:
    """The next value to try: value x factor, a whole number >= 1 (and a new one) over concurrency."""
    if axis is SweepAxis.RATE:
        return _capped(value * factor, max_value)
    nxt = max(1.0, float(round(value * factor)))
    if nxt == value:
        nxt = value + (1.0 if factor > 1 else -1.0)
    return max(1.0, _capped(nxt, max_value))


def midpoint(axis: SweepAxis, good: float, bad: float) -> float | None:
    """Geometric midpoint of the bracket (rounded over concurrency; None once nothing lies between)."""
    mid = math.sqrt(good * bad)
    if axis is SweepAxis.CONCURRENCY:
        mid = float(round(mid))
        return mid if good < mid < bad else None
    return mid
