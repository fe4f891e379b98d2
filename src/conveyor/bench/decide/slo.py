"""Service-level objective: the bounds a run must meet, parsed from flags or a file, and its verdict.

The model: an objective is a set of optional upper bounds. Aggregate bounds (p95 queue time, p95 TTFT,
p95 ITL, p95 end-to-end latency, error rate) are checked against a run's `summary.json`; a missing bound
is simply not checked. Per-request bounds (`ttft_ms`, `tpot_ms`, `e2el_ms`, as vLLM's `--goodput`)
decide which completed responses count as *accepted*: they feed goodput and the cost per accepted
response. Each measurement carries a confidence interval (run_stats.py): a bound is *met* when the
whole interval lies under it, *missed* when the whole interval lies above it, and *undecided* when the
interval straddles it (more requests or repeats are needed). A bound whose measurement is missing (no
completed request, no server metrics) is `no_data` and does not pass: an objective we cannot see is not
met. A summary recorded without intervals is decided on its value alone.
"""

from __future__ import annotations

import enum
import math
import pathlib
from dataclasses import asdict, dataclass, fields
from typing import Any

from conveyor.bench.jsonvalue import Fields
from conveyor.bench.measure.intervals import Interval, IntervalMethod
from conveyor.bench.measure.run_stats import RequestSample
from conveyor.bench.measure.summary import RunSummary
from conveyor.bench.table_file import read_table_file


class SLOError(ValueError):
    """A malformed objective; the message names the key or flag."""


@dataclass(frozen=True)
class SLO:
    """Upper bounds of the objective (None: not part of it)."""

    ttft_p95_ms: float | None = None
    """p95 time to first token over the run, milliseconds."""
    itl_p95_ms: float | None = None
    """p95 inter-token latency (pooled over requests), milliseconds."""
    e2e_p95_ms: float | None = None
    """p95 end-to-end latency, milliseconds."""
    queue_p95_ms: float | None = None
    """p95 server-side queue time (from the server's histogram), milliseconds."""
    error_rate: float | None = None
    """Largest acceptable fraction of failed requests (rejections, timeouts, errors)."""
    ttft_ms: float | None = None
    """Per-request goodput bound on TTFT (vLLM --goodput ttft), milliseconds."""
    tpot_ms: float | None = None
    """Per-request goodput bound on time per output token (vLLM --goodput tpot), milliseconds."""
    e2el_ms: float | None = None
    """Per-request goodput bound on end-to-end latency (vLLM --goodput e2el), milliseconds."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and (not isinstance(value, int | float) or value < 0):
                raise SLOError(f"SLO bound {f.name} must be a number >= 0 (got {value!r})")
        if self.error_rate is not None and self.error_rate > 1:
            raise SLOError(f"SLO bound error_rate is a fraction in [0, 1] (got {self.error_rate})")

    def goodput_bounds(self) -> dict[str, float]:
        """The per-request bounds that are set, keyed as vLLM's goodput: ttft_ms, tpot_ms, e2el_ms."""
        bounds = {"ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms, "e2el_ms": self.e2el_ms}
        return {k: v for k, v in bounds.items() if v is not None}

    def is_empty(self) -> bool:
        return all(getattr(self, f.name) is None for f in fields(self))

    def to_dict(self) -> dict[str, float]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def evaluate(self, summary: RunSummary) -> SLOVerdict:
        """Check the aggregate bounds against one run's summary.json (see `evaluate`)."""
        return evaluate(self, summary)


class BoundStatus(enum.Enum):
    MET = "met"
    MISSED = "missed"
    UNDECIDED = "undecided"
    NO_DATA = "no_data"


BOUND_NAMES = {"ttft_p95_ms": "p95 TTFT", "itl_p95_ms": "p95 ITL", "e2e_p95_ms": "p95 end-to-end latency",
               "queue_p95_ms": "p95 queue time", "error_rate": "error rate"}
"""How each aggregate bound reads in a sentence."""


def format_value(name: str, value: float) -> str:
    """A bound's value with its unit and sensible precision (error rates as percentages)."""
    if math.isinf(value):
        return "unbounded"
    if name == "error_rate":
        return f"{100.0 * value:.3g}%"
    return f"{value:,.0f} ms" if abs(value) >= 100 else f"{value:.3g} ms"


@dataclass(frozen=True)
class BoundCheck:
    """One aggregate bound against its measurement and that measurement's interval."""

    name: str
    """SLO field name, e.g. ttft_p95_ms."""
    bound: float
    """The upper bound."""
    measured: float | None
    """The run's (or point's) value (None: not measured)."""
    status: BoundStatus
    """met (whole interval under the bound), missed (whole interval over), undecided, no_data."""
    interval: Interval | None = None
    """The measurement's interval (None: no data, or recorded without one: decided on the value)."""

    def describe(self) -> str:
        label = BOUND_NAMES.get(self.name, self.name)
        interval = self.interval
        if self.measured is None and interval is None:
            return f"{label} not measured (bound {format_value(self.name, self.bound)}): no data"
        if self.measured is None and interval is not None:  # a histogram's lowest (or +Inf) bucket
            shown = (f"<= {format_value(self.name, interval.high)}" if interval.low == 0 else
                     f"in [{format_value(self.name, interval.low)}, {format_value(self.name, interval.high)}]")
            return f"{label} {shown} vs bound {format_value(self.name, self.bound)}: {self.status.value}"
        shown = format_value(self.name, self.measured or 0.0)
        if interval is not None and interval.method is not IntervalMethod.NONE:
            shown += f" [{format_value(self.name, interval.low)}, {format_value(self.name, interval.high)}]"
        return f"{label} {shown} vs bound {format_value(self.name, self.bound)}: {self.status.value}"


@dataclass(frozen=True)
class SLOVerdict:
    """Every checked bound; met when all are met, missed when one is missed, else undecided/no data."""

    checks: tuple[BoundCheck, ...]
    """One entry per aggregate bound that is set."""
    not_sustained: str | None = None
    """Why the point's server did not show it sustained the offered rate (sustained.py; None: it did).
    Bounds met at a rate the server did not sustain are not capacity, so the verdict is then undecided."""

    @property
    def status(self) -> BoundStatus:
        statuses = {c.status for c in self.checks}
        for status in (BoundStatus.MISSED, BoundStatus.NO_DATA, BoundStatus.UNDECIDED):
            if status in statuses:
                return status
        return BoundStatus.UNDECIDED if self.not_sustained else BoundStatus.MET

    @property
    def passed(self) -> bool:
        return self.status is BoundStatus.MET

    @property
    def decided(self) -> bool:
        return self.status in (BoundStatus.MET, BoundStatus.MISSED)

    @property
    def failures(self) -> tuple[BoundCheck, ...]:
        return tuple(c for c in self.checks if c.status is not BoundStatus.MET)

    def describe(self) -> str:
        text = "; ".join(c.describe() for c in self.checks) if self.checks else "no aggregate bound set"
        return text + (f"; {self.not_sustained}" if self.not_sustained else "")


SUMMARY_KEYS = {"ttft_p95_ms": "p95_ttft_ms", "itl_p95_ms": "p95_itl_ms", "e2e_p95_ms": "p95_e2el_ms",
                "queue_p95_ms": "server.queue_time_p95_ms", "error_rate": "error_rate"}
"""SLO field -> the summary.json key it is checked against ("server." keys live under `server`)."""


def summary_value(summary: RunSummary, key: str) -> float | None:
    if key.startswith("server."):
        return summary.server.value(key.removeprefix("server."))
    return summary.metric(key)


def summary_interval(summary: RunSummary, key: str) -> Interval | None:
    """The interval recorded for `key` in summary.json's `ci` table, or the server's for "server." keys
    (None: recorded without one)."""
    if key.startswith("server."):
        return summary.server.ci.get(key.removeprefix("server."))
    return summary.ci.get(key)


def measured_values(summary: RunSummary) -> dict[str, float | None]:
    """SLO field -> the summary.json value it is checked against (RUNDIR.md names)."""
    return {name: summary_value(summary, key) for name, key in SUMMARY_KEYS.items()}


def check_bound(name: str, bound: float, measured: float | None, interval: Interval | None) -> BoundCheck:
    """met when the interval lies under the bound, missed when above it, undecided when it straddles."""
    if measured is None and interval is None:
        return BoundCheck(name, bound, None, BoundStatus.NO_DATA)
    if interval is None:
        status = BoundStatus.MET if (measured or 0.0) <= bound else BoundStatus.MISSED
        return BoundCheck(name, bound, measured, status, None)
    if interval.high <= bound:
        status = BoundStatus.MET
    elif interval.low > bound:
        status = BoundStatus.MISSED
    else:
        status = BoundStatus.UNDECIDED
    return BoundCheck(name, bound, measured, status, interval)


def evaluate(slo: SLO, summary: RunSummary) -> SLOVerdict:
    """Check each aggregate bound of `slo` against one run's summary (and its intervals, if recorded)."""
    checks = []
    for name, key in SUMMARY_KEYS.items():
        bound = getattr(slo, name)
        if bound is not None:
            checks.append(check_bound(name, float(bound), summary_value(summary, key), summary_interval(summary, key)))
    return SLOVerdict(tuple(checks))


def describe_objective(slo: SLO) -> str:
    """The objective as a sentence: 'p95 TTFT at most 500 ms, error rate at most 1%; accepted responses: ...'."""
    parts = [f"{BOUND_NAMES[n]} at most {format_value(n, float(getattr(slo, n)))}"
             for n in SUMMARY_KEYS if getattr(slo, n) is not None]
    per_request = [f"{k.removesuffix('_ms').upper()} <= {v:g} ms" for k, v in slo.goodput_bounds().items()]
    if not parts and not per_request:
        return "none set (give --slo): every run meets it and the choice rests on cost alone"
    text = ", ".join(parts) if parts else "no aggregate bound"
    if per_request:
        text += "; a response is accepted when " + " and ".join(per_request)
    return text + "."


def request_meets_goodput(slo: SLO, record: RequestSample) -> bool:
    """Whether one requests.jsonl record completed and met every per-request bound."""
    if not record.completed:
        return False
    values_s = {"ttft_ms": record.ttft_s, "tpot_ms": record.tpot_s, "e2el_ms": record.e2e_s}
    for key, bound_ms in slo.goodput_bounds().items():
        value_s = values_s[key]
        if value_s is not None and value_s * 1000.0 > bound_ms:
            return False
    return True


_FIELD_NAMES = frozenset(f.name for f in fields(SLO))


def slo_from_mapping(mapping: dict[str, Any], origin: str) -> SLO:
    """An SLO from {field: number}; unknown keys are rejected, naming `origin`."""
    unknown = set(mapping) - _FIELD_NAMES
    if unknown:
        raise SLOError(f"{origin}: unknown SLO key(s) {sorted(unknown)}; known: {sorted(_FIELD_NAMES)}")
    try:
        values = {k: None if v is None else float(v) for k, v in mapping.items()}
    except (TypeError, ValueError) as error:
        raise SLOError(f"{origin}: every SLO bound must be a number ({error})") from None
    return SLO(**values)


def parse_slo_flag(text: str) -> SLO:
    """`ttft_p95_ms=500,e2e_p95_ms=5000,error_rate=0.01`, or a path to a .json / .toml file."""
    path = pathlib.Path(text)
    if text.endswith((".json", ".toml")) or path.is_file():
        return load_slo_file(path)
    mapping: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise SLOError(f"--slo: expected KEY=VALUE, got {item!r} (e.g. ttft_p95_ms=500,error_rate=0.01)")
        mapping[key.strip()] = value.strip()
    return slo_from_mapping(mapping, "--slo")


def load_slo_file(path: pathlib.Path) -> SLO:
    """An SLO from a JSON or TOML file, either flat or under an `slo` key/table."""
    if not path.is_file():
        raise SLOError(f"--slo: file {path} does not exist")
    data = read_table_file(path)
    nested = Fields.of(data, str(path)).raw("slo") if isinstance(data, dict) else None
    if isinstance(nested, dict):
        data = nested
    if not isinstance(data, dict):
        raise SLOError(f"{path}: expected a table/object of SLO bounds")
    return slo_from_mapping(data, str(path))
