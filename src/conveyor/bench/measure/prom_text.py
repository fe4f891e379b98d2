"""A small parser for the Prometheus text exposition format, and histogram_quantile.

Enough for what servers expose on /metrics: `# HELP`/`# TYPE` comments are skipped, samples are
`name{label="value",...} value [timestamp]` with escaped quotes inside label values. Series of one
metric name are summed over their labels (a server has one `model_name`), except where a caller asks for
labels. Histogram quantiles follow Prometheus' histogram_quantile: find the bucket holding rank q·count
and interpolate linearly inside it, the lowest bucket starting at 0; a rank in the +Inf bucket returns
the highest finite bound.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


@dataclass(frozen=True)
class Sample:
    """One exposed series value."""

    name: str
    """Metric name (histograms: with _bucket/_sum/_count)."""
    labels: dict[str, str]
    """Label set."""
    value: float
    """Sample value."""


def _unescape(value: str) -> str:
    return value.replace("\\n", "\n").replace('\\"', '"').replace("\\\\", "\\")


def _parse_value(text: str) -> float:
    lowered = text.lower()
    if lowered in ("+inf", "inf"):
        return math.inf
    if lowered == "-inf":
        return -math.inf
    return float(text)


def parse_prometheus(text: str) -> list[Sample]:
    """Parse exposition text; malformed lines are skipped (a scrape must never crash the run)."""
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        labels = {k: _unescape(v) for k, v in _LABEL.findall(m.group(3) or "")}
        try:
            samples.append(Sample(m.group(1), labels, _parse_value(m.group(4))))
        except ValueError:
            continue
    return samples


class Snapshot:
    """One scrape, indexed by metric name."""

    def __init__(self, samples: list[Sample]) -> None:
        self.by_name: dict[str, list[Sample]] = {}
        for s in samples:
            self.by_name.setdefault(s.name, []).append(s)

    @classmethod
    def from_text(cls, text: str) -> Snapshot:
        return cls(parse_prometheus(text))

    def total(self, *names: str) -> float | None:
        """Sum over label sets of the first name present (names are fallbacks, e.g. older vLLM names)."""
        for name in names:
            if name in self.by_name:
                return sum(s.value for s in self.by_name[name])
        return None

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """Values of one metric summed per value of `label` (series without it are left out)."""
        out: dict[str, float] = {}
        for s in self.by_name.get(name, []):
            if label in s.labels:
                out[s.labels[label]] = out.get(s.labels[label], 0.0) + s.value
        return out

    def labels(self, name: str) -> dict[str, str] | None:
        series = self.by_name.get(name)
        return dict(series[0].labels) if series else None

    def buckets(self, histogram: str) -> list[tuple[float, float]]:
        """[(upper bound, cumulative count)] summed over label sets, sorted by bound."""
        acc: dict[float, float] = {}
        for s in self.by_name.get(f"{histogram}_bucket", []):
            if "le" in s.labels:
                le = _parse_value(s.labels["le"])
                acc[le] = acc.get(le, 0.0) + s.value
        return sorted(acc.items())


def bucket_delta(after: list[tuple[float, float]], before: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Per-bound difference of two cumulative bucket lists (bounds missing before count as 0)."""
    prior = dict(before)
    return [(le, count - prior.get(le, 0.0)) for le, count in after]


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile over cumulative buckets; None without observations."""
    if len(buckets) < 2 or not math.isinf(buckets[-1][0]) or not 0.0 <= q <= 1.0:
        return None
    total = buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    b = next(i for i, (_, count) in enumerate(buckets) if count >= rank)
    if b == len(buckets) - 1:
        return buckets[-2][0]
    if b == 0 and buckets[0][0] <= 0:
        return buckets[0][0]
    start, end, count = 0.0, buckets[b][0], buckets[b][1]
    if b > 0:
        start = buckets[b - 1][0]
        count -= buckets[b - 1][1]
        rank -= buckets[b - 1][1]
    return start + (end - start) * (rank / count) if count > 0 else end
