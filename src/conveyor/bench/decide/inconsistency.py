"""A configuration that misses the objective at a lower rate and meets it at a higher one.

More load never makes a server faster, so such a pair is a measurement that contradicts itself, not a
capacity and not "never meets the objective". A higher point that met every bound but was not shown
sustained (sustained.py) contradicts the miss as much: its latencies were better under more load. The report says so and names the likely cause, from what
the runs recorded: too few requests (a p95 from fewer than 40 requests, or a single repeat, moves a lot
between runs), a different prefix-cache hit rate (an earlier run warmed the cache), or the run order
(the higher rate ran later, on a server warmed by the runs before it). Without any of these, the cause
is noise between runs, and repeating both points is the remedy.
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.bench.decide.evaluation import ConfigEval, PointEval
from conveyor.bench.decide.point_verdict import PointStatus

MIN_REQUESTS = 40
"""Requests a point needs for its p95 to be bounded from above (intervals.py)."""
CACHE_HIT_GAP = 0.1
"""Prefix-cache hit rates further apart than this make the cache state a likely cause."""


@dataclass(frozen=True)
class Inconsistency:
    """A missed point below a met one, and why that likely happened."""

    config: str
    """Configuration name."""
    missed: PointEval
    """The lower rate, missed."""
    met: PointEval
    """The higher rate, met."""
    causes: tuple[str, ...]
    """Likely causes, most specific first."""

    def describe(self) -> str:
        met = "met" if self.met.status is PointStatus.MET else "met every bound"
        return (f"{self.config}: inconsistent measurement: missed at {self.missed.offered_rate:.3g} req/s but {met} "
                f"at {self.met.offered_rate:.3g} req/s; likely cause: {'; '.join(self.causes)}")


def _requests(point: PointEval) -> int:
    return sum(r.summary.completed + r.summary.failed for r in point.valid_runs)


def _hit_rate(point: PointEval) -> float | None:
    values = [v for v in (r.metric("prefix_cache_hit_rate") for r in point.valid_runs) if v is not None]
    return sum(values) / len(values) if values else None


def _started(point: PointEval) -> str:
    """The first repeat's ISO start time ("" when not recorded)."""
    return min((r.summary.identity.started_at for r in point.valid_runs if r.summary.identity.started_at), default="")


def likely_causes(missed: PointEval, met: PointEval) -> tuple[str, ...]:
    causes = []
    few = [p for p in (missed, met) if _requests(p) < MIN_REQUESTS or len(p.valid_runs) < 2]
    if few:
        causes.append("too few requests (" + ", ".join(
            f"{_requests(p)} in {len(p.valid_runs)} repeat(s) at {p.offered_rate:.3g} req/s" for p in few) + ")")
    hits = _hit_rate(missed), _hit_rate(met)
    if hits[0] is not None and hits[1] is not None and abs(hits[1] - hits[0]) > CACHE_HIT_GAP:
        causes.append(f"the cache state (prefix-cache hit rate {hits[0]:.0%} at {missed.offered_rate:.3g} req/s, "
                      f"{hits[1]:.0%} at {met.offered_rate:.3g})")
    first_missed, first_met = _started(missed), _started(met)
    if first_missed and first_met and first_met > first_missed:
        causes.append(f"the run order ({met.offered_rate:.3g} req/s ran later, on a server the earlier runs warmed)")
    return tuple(causes) or ("noise between runs: repeat both points (--repeats, --max-repeats)",)


def _bounds_met(point: PointEval) -> bool:
    """Met, or every bound met at a rate not shown sustained."""
    checks = point.verdict.checks
    return point.status is PointStatus.MET or (bool(checks) and point.verdict.not_sustained is not None and all(
        c.status.value == "met" for c in checks))


def find_inconsistency(config: ConfigEval) -> Inconsistency | None:
    """The first missed point with a point above it that met every bound (None: the measurements agree)."""
    missed = config.first_missed()
    if missed is None:
        return None
    met = next((p for p in config.points if _bounds_met(p) and p.offered_rate > missed.offered_rate), None)
    return None if met is None else Inconsistency(config.name, missed, met, likely_causes(missed, met))
