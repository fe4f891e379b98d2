"""Service-level objective: the bounds a run must meet, parsed from flags or a file, and its verdict.

The model: an objective is a set of optional upper bounds. Aggregate bounds (p95 queue time, p95 TTFT,
p95 ITL, p95 end-to-end latency, error rate) are checked against a run's `summary.json`; a missing bound
is simply not checked. Per-request bounds (`ttft_ms`, `tpot_ms`, `e2el_ms`, as vLLM's `--goodput`)
decide which completed responses count as *accepted*: they feed goodput and the cost per accepted
response. A bound whose measurement is missing (no completed request, no server metrics) is reported
as `no_data` and does not pass: an objective we cannot see is not met.
"""

from __future__ import annotations

import enum
import json
import pathlib
import tomllib
from dataclasses import asdict, dataclass, fields
from typing import Any


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

    def evaluate(self, summary: dict[str, Any]) -> SLOVerdict:
        """Check the aggregate bounds against one run's summary.json (see `evaluate`)."""
        return evaluate(self, summary)


class BoundStatus(enum.Enum):
    PASS = "pass"
    FAIL = "fail"
    NO_DATA = "no_data"


@dataclass(frozen=True)
class BoundCheck:
    """One aggregate bound against its measurement."""

    name: str
    """SLO field name, e.g. ttft_p95_ms."""
    bound: float
    """The upper bound."""
    measured: float | None
    """The run's value (None: not measured)."""
    status: BoundStatus
    """pass, fail or no_data."""

    def describe(self) -> str:
        shown = "n/a" if self.measured is None else f"{self.measured:.4g}"
        return f"{self.name} = {shown} (bound {self.bound:.4g}): {self.status.value}"


@dataclass(frozen=True)
class SLOVerdict:
    """Every checked bound; the objective is met when all pass."""

    checks: tuple[BoundCheck, ...]
    """One entry per aggregate bound that is set."""

    @property
    def passed(self) -> bool:
        return all(c.status is BoundStatus.PASS for c in self.checks)

    @property
    def failures(self) -> tuple[BoundCheck, ...]:
        return tuple(c for c in self.checks if c.status is not BoundStatus.PASS)

    def describe(self) -> str:
        if not self.checks:
            return "no aggregate bound set"
        return "; ".join(c.describe() for c in self.checks)


def _as_float(value: object) -> float | None:
    if value is None or isinstance(value, str):
        return None
    return float(value)  # type: ignore[arg-type]


def measured_values(summary: dict[str, Any]) -> dict[str, float | None]:
    """SLO field -> the summary.json value it is checked against (RUNDIR.md names)."""
    server = summary.get("server") or {}
    return {
        "ttft_p95_ms": _as_float(summary.get("p95_ttft_ms")),
        "itl_p95_ms": _as_float(summary.get("p95_itl_ms")),
        "e2e_p95_ms": _as_float(summary.get("p95_e2el_ms")),
        "queue_p95_ms": _as_float(server.get("queue_time_p95_ms")),
        "error_rate": _as_float(summary.get("error_rate")),
    }


def evaluate(slo: SLO, summary: dict[str, Any]) -> SLOVerdict:
    """Check each aggregate bound of `slo` against one run's summary."""
    checks = []
    for name, measured in measured_values(summary).items():
        bound = getattr(slo, name)
        if bound is None:
            continue
        if measured is None:
            status = BoundStatus.NO_DATA
        else:
            status = BoundStatus.PASS if measured <= bound else BoundStatus.FAIL
        checks.append(BoundCheck(name, float(bound), measured, status))
    return SLOVerdict(tuple(checks))


def request_meets_goodput(slo: SLO, record: dict[str, Any]) -> bool:
    """Whether one requests.jsonl record completed and met every per-request bound."""
    if record.get("status") != "completed":
        return False
    values_s = {"ttft_ms": record.get("ttft_s"), "tpot_ms": record.get("tpot_s"), "e2el_ms": record.get("e2e_s")}
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
    text = path.read_text()
    data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    if isinstance(data, dict) and isinstance(data.get("slo"), dict):
        data = data["slo"]
    if not isinstance(data, dict):
        raise SLOError(f"{path}: expected a table/object of SLO bounds")
    return slo_from_mapping(data, str(path))
