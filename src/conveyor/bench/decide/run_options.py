"""The options a sweep passes to every run: BenchRunConfig fields beyond what the run template fixes.

They come from a study file's `[run]` table, from the sweep's and study's flags, or from a caller, and
are read once, here, into a RunOptions record: an unknown key or a value of the wrong type is an error
that names where it was read, before any server starts, instead of a TypeError at the first run. A field
left None is not given, so the run gets BenchRunConfig's default. The record also reads as a mapping of
the options given (what `BenchRunConfig(**options)` takes, and what older callers compare with a dict).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

from conveyor.bench.load.retry import RetryPolicy


class RunOptionsError(ValueError):
    """An unknown run option, or one of the wrong type; the message names where it was read."""


@dataclass(frozen=True, kw_only=True, eq=False)  # eq=False: Mapping's equality (with dicts too) applies
class RunOptions(Mapping[str, object]):
    """BenchRunConfig fields every run of a sweep shares (None: not given, the runner's default)."""

    seed: int | None = None
    """Arrival seed of repeat 0 (repeat k uses seed + k; not given: 0)."""
    num_requests: int | None = None
    """Send only the first N trace requests."""
    request_rate: float | None = None
    """Offered rate of a concurrency sweep's runs (a rate sweep sets its own)."""
    max_concurrency: int | None = None
    """In-flight cap of a rate sweep's runs (a concurrency sweep sets its own)."""
    profile: str | None = None
    """GuideLLM-style load profile."""
    arrival: str | None = None
    """poisson | gamma | constant | replay."""
    burstiness: float | None = None
    """Gamma shape k."""
    time_scale: float | None = None
    """replay: trace seconds per wall second."""
    endpoint: str | None = None
    """completions | chat."""
    temperature: float | None = None
    """Sent with every request."""
    model: str | None = None
    """Model name to request."""
    api_key: str | None = None
    """Bearer token for the server."""
    request_timeout_s: float | None = None
    """Per-request timeout."""
    scrape_interval_s: float | None = None
    """Gauge sampling period."""
    max_send_lag_p99_ms: float | None = None
    """A run whose p99 send lag exceeds this is invalid."""
    max_client_cpu: float | None = None
    """A run whose client used this much of a core is invalid."""
    warmup_requests: int | None = None
    """Warm-up requests: recorded, not summarized."""
    warmup_s: float | None = None
    """Warm-up seconds."""
    cooldown_requests: int | None = None
    """Cool-down requests."""
    cooldown_s: float | None = None
    """Cool-down seconds."""
    num_workers: int | None = None
    """Load-generator processes."""
    show_progress: bool | None = None
    """The per-run progress line."""
    command: str | None = None
    """The command line recorded in command.txt."""
    retry: RetryPolicy | None = None
    """Retry 503s honouring Retry-After."""
    cache_mode: str | None = None
    """isolated | warm."""
    collect_step_log: bool | None = None
    """Write the server's step log."""

    @classmethod
    def from_mapping(cls, data: Mapping[str, object], origin: str) -> RunOptions:
        """Options from {field: value}; `origin` (e.g. 'study.toml [run]') is named in any error."""
        known = {f.name: str(f.type) for f in fields(cls)}
        unknown = set(data) - set(known)
        if unknown:
            raise RunOptionsError(f"{origin}: unknown key(s) {sorted(unknown)}; known: {sorted(known)}")
        for key, value in data.items():
            if value is not None and not _has_type(value, known[key]):
                raise RunOptionsError(f"{origin}: {key} must be {known[key].removesuffix(' | None')}, got {value!r}")
        return cls(**{k: v for k, v in data.items() if v is not None})  # type: ignore[arg-type]  # checked above

    def given(self) -> dict[str, Any]:
        """The options given, as BenchRunConfig keyword arguments."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def __getitem__(self, key: str) -> object:
        found = self.given()
        if key not in found:
            raise KeyError(key)
        return found[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.given())

    def __len__(self) -> int:
        return len(self.given())


def _has_type(value: object, annotation: str) -> bool:
    """Whether value fits a field's `X | None` annotation; a bool is not a number (TOML `seed = true`)."""
    if isinstance(value, bool):
        return annotation == "bool | None"
    kinds: dict[str, tuple[type, ...]] = {"int | None": (int,), "float | None": (int, float), "str | None": (str,),
                                          "RetryPolicy | None": (RetryPolicy,)}
    return isinstance(value, kinds.get(annotation, ()))
