"""summary.json's `server` object as a typed record, and the interval tables every summary level carries.

The model: what the server's /metrics said over a run is a set of named numbers (queue time
percentiles, preemptions, prefix-cache hit rate, KV usage, peak GPU memory, speculative decoding
counters; server_metrics.py names them), a few named lists (histogram buckets, acceptance per draft
position), a few labels (which histogram was read, where GPU memory came from) and their intervals.
Numbers are read by name because objectives and reports name them by their summary.json keys.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from conveyor.bench.jsonvalue import JSON, Fields
from conveyor.bench.measure.intervals import Interval


def intervals_from(f: Fields) -> dict[str, Interval]:
    """A `ci` table: key -> interval."""
    return {key: Interval.from_json(dict(entry.data), entry.where) for key, entry in f.children().items()}


def intervals_to_json(table: Mapping[str, Interval]) -> dict[str, JSON]:
    return {key: interval.to_json() for key, interval in table.items()}


def _json_number(value: float) -> JSON:
    return "inf" if math.isinf(value) else value


@dataclass(frozen=True)
class ServerSummary:
    """What the server's /metrics said over one run (all None when it exposes no metrics)."""

    available: bool = False
    """Whether /metrics was scraped before and after the run."""
    values: Mapping[str, float | None] = field(default_factory=dict)
    """Every named number: queue_time_p95_ms, num_preemptions, prefix_cache_hit_rate, ..."""
    lists: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    """Named lists of numbers: a percentile's bucket bounds, acceptance per draft position."""
    labels: Mapping[str, str] = field(default_factory=dict)
    """Named labels: queue_time_histogram (the metric read), gpu_memory_source."""
    queue_time_buckets: tuple[tuple[float, float], ...] = ()
    """The queue-time histogram's (upper bound s, count) deltas over the run."""
    ci: Mapping[str, Interval] = field(default_factory=dict)
    """Key -> its interval (histogram percentiles)."""

    def value(self, name: str) -> float | None:
        return self.values.get(name)

    def numbers(self, name: str) -> tuple[float, ...]:
        """A named list of numbers; () when the server gave none."""
        return self.lists.get(name, ())

    @classmethod
    def from_json(cls, f: Fields) -> ServerSummary:
        lists = {k: f.number_list(k) for k, v in f.data.items() if isinstance(v, list) and k != "queue_time_buckets"}
        labels = {k: v for k, v in f.data.items() if isinstance(v, str) and v != "inf"}
        buckets = f.raw("queue_time_buckets")
        pairs = tuple(Fields.of({"le": b[0], "n": b[1]}, f"{f.where}.queue_time_buckets") for b in buckets
                      if isinstance(b, list) and len(b) == 2) if isinstance(buckets, list) else ()
        return cls(f.flag("available", False), {k: v for k, v in f.numbers().items()}, lists, labels,
                   tuple((p.number("le"), p.number("n")) for p in pairs), intervals_from(f.child("ci")))

    def to_json(self) -> dict[str, JSON]:
        out: dict[str, JSON] = {"available": self.available}
        out.update({k: None if v is None else _json_number(v) for k, v in self.values.items()})
        out.update({k: [_json_number(x) for x in v] for k, v in self.lists.items()})
        out.update(self.labels)
        if self.queue_time_buckets:
            out["queue_time_buckets"] = [[_json_number(le), n] for le, n in self.queue_time_buckets]
        if self.ci:
            out["ci"] = intervals_to_json(self.ci)
        return out
