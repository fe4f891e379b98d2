"""The options a sweep or study passes on: to every run (RunOptions, BenchRunConfig fields beyond what the
run template fixes) and to every server launch (ServerOptions, ServerSpec fields beyond the configuration's).

They come from a study file's `[run]` and `[server]` tables, from the sweep's and study's flags, or from a
caller, and are read once, here: an unknown key or a value of the wrong type is an error that names where
it was read, before any server starts, instead of a TypeError at the first run or launch. A field left
None is not given, so the run or server gets its own default. A record also reads as a mapping of the
options given (what `BenchRunConfig(**options)` takes, and what older callers compare with a dict).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

from conveyor.bench.load.retry import RetryPolicy


class RunOptionsError(ValueError):
    """An unknown option, or one of the wrong type; the message names where it was read."""


class _GivenOptions(Mapping[str, object]):
    """An options record (a frozen dataclass whose fields default to None) read from and as a mapping."""

    @classmethod
    def _checked(cls, data: Mapping[str, object], origin: str) -> dict[str, Any]:
        """The given (non-null) options of data, each name and type checked; `origin` is named in errors."""
        known = {f.name: str(f.type) for f in fields(cls)}  # type: ignore[arg-type]  # subclasses are dataclasses
        unknown = set(data) - set(known)
        if unknown:
            raise RunOptionsError(f"{origin}: unknown key(s) {sorted(unknown)}; known: {sorted(known)}")
        for key, value in data.items():
            if value is not None and not _has_type(value, known[key]):
                raise RunOptionsError(f"{origin}: {key} must be {known[key].removesuffix(' | None')}, got {value!r}")
        return {k: v for k, v in data.items() if v is not None}

    def given(self) -> dict[str, Any]:
        """The options given, as keyword arguments."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]
        return {k: v for k, v in values.items() if v is not None}

    def __getitem__(self, key: str) -> object:
        found = self.given()
        if key not in found:
            raise KeyError(key)
        return found[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.given())

    def __len__(self) -> int:
        return len(self.given())


@dataclass(frozen=True, kw_only=True, eq=False)  # eq=False: Mapping's equality (with dicts too) applies
class RunOptions(_GivenOptions):
    """BenchRunConfig fields every run of a sweep shares (None: not given, the runner's default)."""

    seed: int | None = None
    """Arrival seed of repeat 0 (repeat k uses seed + k; not given: 0)."""
    num_requests: int | None = None
    """Send only the first N trace requests."""
    duration_s: float | None = None
    """Seconds of arrivals per run: ceil(rate × duration_s) requests, so every rate runs as long."""
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
        return cls(**cls._checked(data, origin))


@dataclass(frozen=True, kw_only=True, eq=False)
class ServerOptions(_GivenOptions):
    """ServerSpec fields every configuration of a study shares (None: not given, ServerSpec's default)."""

    env: dict[str, str] | None = None
    """Extra environment variables for the server process."""
    host: str | None = None
    """Address the server binds and the benchmark connects to."""
    port: int | None = None
    """Port (0: pick a free one at launch)."""
    health_path: str | None = None
    """GET path that returns 200 once the server is ready."""
    startup_timeout_s: float | None = None
    """How long to wait for health."""
    stop_grace_s: float | None = None
    """SIGTERM-to-SIGKILL grace."""
    num_warmup_requests: int | None = None
    """Short completions sent before measuring."""
    model: str | None = None
    """`model` field of warm-up requests."""

    @classmethod
    def from_mapping(cls, data: Mapping[str, object], origin: str) -> ServerOptions:
        """Options from {field: value}; `origin` (e.g. 'study.toml [server]') is named in any error."""
        return cls(**cls._checked(data, origin))


def _has_type(value: object, annotation: str) -> bool:
    """Whether value fits a field's `X | None` annotation; a bool is not a number (TOML `seed = true`)."""
    if isinstance(value, bool):
        return annotation == "bool | None"
    kinds: dict[str, tuple[type, ...]] = {"int | None": (int,), "float | None": (int, float), "str | None": (str,),
                                          "RetryPolicy | None": (RetryPolicy,), "dict[str, str] | None": (dict,)}
    return isinstance(value, kinds.get(annotation, ()))
