"""A run's summary as typed records: what `conveyor bench run` measured, and what every later stage reads.

The model: summary.json is the file form of one `RunSummary`. The runner builds it, writes it with
`to_json`, and everything after (sweep, decision, report, plots) reads the typed record that
`from_json` returns. JSON appears only at that edge. Keys keep `vllm bench serve`'s names (RUNDIR.md),
so a summary compares with vLLM's own output. `from_json` reads every schema version written so far: a
key an older run lacks takes its default, and keys this code does not know are kept in `extra` so that a
round trip loses nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from conveyor.bench.jsonvalue import JSON, Fields
from conveyor.bench.measure.cache_summary import CacheSummary
from conveyor.bench.measure.intervals import Interval
from conveyor.bench.measure.server_summary import (
    ServerSummary,
    intervals_from,
    intervals_to_json,
)

SCHEMA_VERSION = 1
"""summary.json's layout version (unchanged by the typed records: the file is the same)."""
LATENCY_NAMES = ("ttft", "tpot", "itl", "e2el")
LATENCY_STATS = ("mean", "median", "std", "p50", "p90", "p95", "p99")


def latency_keys(names: tuple[str, ...] = LATENCY_NAMES, stats: tuple[str, ...] = LATENCY_STATS) -> tuple[str, ...]:
    """vLLM's latency keys: `p95_ttft_ms`, `median_e2el_ms`, ..."""
    return tuple(f"{stat}_{name}_ms" for name in names for stat in stats)


CLASS_LATENCY_KEYS = (*latency_keys(("ttft", "e2el"), ("p50", "p95", "p99")), *latency_keys(("itl",), ("p50", "p95")))
"""The latency keys of one class (or one session turn)."""
_COUNTS = ("num_prompts", "completed", "failed", "cancelled")


@dataclass(frozen=True)
class ClassSummary:
    """One request class (or one session turn) over the whole run's duration."""

    num_prompts: int
    """Requests of the class in the measured window."""
    completed: int
    """Of which completed."""
    failed: int
    """Of which failed."""
    cancelled: int
    """Of which cancelled by the client."""
    request_throughput: float
    """Completed per second of the run (so the classes add up to the total)."""
    output_throughput: float
    """Output tokens per second of the run."""
    error_rate: float
    """failed / (sent - cancelled)."""
    latency: Mapping[str, float | None]
    """CLASS_LATENCY_KEYS -> ms (None: no data)."""
    ci: Mapping[str, Interval] = field(default_factory=dict)
    """Intervals of the class's keys (run_stats.py)."""
    mean_prompt_tokens: float | None = None
    """Session turns only: the mean prompt tokens sent."""

    def value(self, key: str) -> float | None:
        scalars: dict[str, float | None] = {"request_throughput": self.request_throughput,
                                             "output_throughput": self.output_throughput,
                                             "error_rate": self.error_rate}
        return scalars[key] if key in scalars else self.latency.get(key)

    @classmethod
    def from_json(cls, f: Fields) -> ClassSummary:
        return cls(f.integer("num_prompts"), f.integer("completed"), f.integer("failed"), f.integer("cancelled"),
                   f.number("request_throughput"), f.number("output_throughput"), f.number("error_rate"),
                   {k: f.opt_number(k) for k in CLASS_LATENCY_KEYS if k in f.data},
                   intervals_from(f.child("ci")), f.opt_number("mean_prompt_tokens"))

    def to_json(self) -> dict[str, JSON]:
        out: dict[str, JSON] = {"num_prompts": self.num_prompts, "completed": self.completed, "failed": self.failed,
                                "cancelled": self.cancelled, "request_throughput": self.request_throughput,
                                "output_throughput": self.output_throughput, **self.latency,
                                "error_rate": self.error_rate}
        if self.mean_prompt_tokens is not None:
            out["mean_prompt_tokens"] = self.mean_prompt_tokens
        if self.ci:
            out["ci"] = intervals_to_json(self.ci)
        return out


@dataclass(frozen=True)
class RetrySummary:
    """What the retry middleware did (only with --retry)."""

    max_retries: int
    """The policy's bound per request."""
    num_retried_requests: int
    """Requests retried at least once."""
    num_retries: int
    """Retries in all."""
    retry_wait_s: float
    """Time spent waiting between attempts."""

    @classmethod
    def from_json(cls, f: Fields) -> RetrySummary:
        return cls(f.integer("max_retries"), f.integer("num_retried_requests"), f.integer("num_retries"),
                   f.number("retry_wait_s"))

    def to_json(self) -> dict[str, JSON]:
        return {"max_retries": self.max_retries, "num_retried_requests": self.num_retried_requests,
                "num_retries": self.num_retries, "retry_wait_s": self.retry_wait_s}


@dataclass(frozen=True)
class Simulated:
    """Marks a run `conveyor simulate --trace` wrote: the real scheduler on a virtual clock, not a server."""

    step_time: str
    """The step-time model that priced each step, as the simulation printed it."""
    calibration: str | None = None
    """The calibration file that model came from (None: the two-parameter model)."""
    target_gpu: str | None = None
    """Cross-hardware: the GPU the calibration was scaled to (None: the hardware it was fitted on)."""
    gpu_name: str | None = None
    """The GPU the priced steps stand for, recorded as the run's fixed.gpu_name so that reports group and
    price simulated runs by GPU as they do measured ones: the calibration's GPU, or the target's catalog
    name (None: a CPU calibration or the two-parameter model)."""

    @classmethod
    def from_json(cls, f: Fields) -> Simulated | None:
        if not f.data:
            return None
        return cls(f.text("step_time"), f.opt_text("calibration"), f.opt_text("target_gpu"), f.opt_text("gpu_name"))

    def to_json(self) -> dict[str, JSON]:
        return {"step_time": self.step_time, "calibration": self.calibration, "target_gpu": self.target_gpu,
                "gpu_name": self.gpu_name}


_IDENTITY_TEXT = ("label", "base_url", "model", "endpoint", "trace_path", "trace_version", "arrival", "profile",
                  "started_at")
_TOTALS = ("duration", "total_input_tokens", "total_output_tokens", "request_throughput", "output_throughput",
           "total_token_throughput")
_KNOWN = {"schema_version", *_IDENTITY_TEXT, "temperature", "request_rate", "burstiness", "max_concurrency", "seed",
          *_COUNTS, "num_sent", *_TOTALS, *latency_keys(), "slo", "goodput", "error_rate", "errors_by_kind",
          "per_class", "send_lag_p99_ms", "max_send_lag_p99_ms", "window", "client", "num_sessions", "per_turn",
          "valid", "invalid_reason", "invalid_reasons", "client_cpu_utilization", "num_client_side_errors",
          "server", "ci", "fixed", "retries", "cache", "simulated"}


@dataclass(frozen=True)
class RunTotals:
    """The run's duration, token totals and throughputs (per second of the duration); None: a key the file
    lacks, left out again when written."""

    duration: float | None = None
    """First dispatch to last completion (s)."""
    total_input_tokens: float | None = None
    """Prompt tokens of the completed requests."""
    total_output_tokens: float | None = None
    """Output tokens of the completed requests."""
    request_throughput: float | None = None
    """Completed requests per second."""
    output_throughput: float | None = None
    """Output tokens per second."""
    total_token_throughput: float | None = None
    """Prompt and output tokens per second."""

    @classmethod
    def from_json(cls, f: Fields) -> RunTotals:
        return cls(**{k: f.number(k) for k in _TOTALS if k in f.data})

    def as_dict(self) -> dict[str, float]:
        """The keys the file has, in summary.json's order."""
        values = (self.duration, self.total_input_tokens, self.total_output_tokens, self.request_throughput,
                  self.output_throughput, self.total_token_throughput)
        return {k: v for k, v in zip(_TOTALS, values) if v is not None}


@dataclass(frozen=True)
class RunIdentity:
    """What was run, against what, and how the load was shaped."""

    label: str
    """The run's name (defaults to its directory's)."""
    base_url: str = ""
    """The server driven."""
    model: str = ""
    """The served model's name."""
    endpoint: str = ""
    """completions | chat."""
    trace_path: str = ""
    """The trace file."""
    trace_version: str = ""
    """Its format version."""
    arrival: str | None = None
    """poisson | gamma | constant | replay."""
    profile: str | None = None
    """GuideLLM-style load profile, if one was used."""
    started_at: str = ""
    """ISO time of the first dispatch."""
    request_rate: float = math.inf
    """Offered req/s (inf: all at once)."""
    burstiness: float | None = None
    """Gamma shape (1: Poisson)."""
    max_concurrency: int | None = None
    """In-flight cap, if any."""
    seed: int | None = None
    """Arrival seed."""
    temperature: float | None = None
    """Sampling temperature sent."""

    @classmethod
    def from_json(cls, f: Fields, default_label: str) -> RunIdentity:
        texts = {k: f.opt_text(k) for k in _IDENTITY_TEXT}
        return cls(label=texts["label"] or default_label,
                   **{k: v or "" for k, v in texts.items() if k not in ("label", "arrival", "profile")},
                   arrival=texts["arrival"], profile=texts["profile"],
                   request_rate=f.number("request_rate", math.inf), burstiness=f.opt_number("burstiness"),
                   max_concurrency=f.opt_integer("max_concurrency"), seed=f.opt_integer("seed"),
                   temperature=f.opt_number("temperature"))

    def to_json(self) -> dict[str, JSON]:
        return {"label": self.label, "base_url": self.base_url, "model": self.model, "endpoint": self.endpoint,
                "temperature": self.temperature, "trace_path": self.trace_path, "trace_version": self.trace_version,
                "request_rate": "inf" if math.isinf(self.request_rate) else self.request_rate,
                "burstiness": self.burstiness, "arrival": self.arrival, "profile": self.profile,
                "max_concurrency": self.max_concurrency, "seed": self.seed, "started_at": self.started_at}


@dataclass(frozen=True)
class Validity:
    """Whether the run measured the server (and not the client), and why not."""

    valid: bool = True
    """False: the run is listed, marked INVALID, and counted nowhere."""
    invalid_reason: str | None = None
    """The first reason."""
    invalid_reasons: tuple[str, ...] = ()
    """Every reason."""
    client_cpu_utilization: float | None = None
    """The benchmark process's CPU share during the open loop."""
    num_client_side_errors: int | None = None
    """Requests that failed in the client, not the server."""
    send_lag_p99_ms: float | None = None
    """p99 of dispatch lateness."""
    max_send_lag_p99_ms: float | None = None
    """Its bound."""

    @classmethod
    def from_json(cls, f: Fields) -> Validity:
        return cls(f.flag("valid", True), f.opt_text("invalid_reason"), f.text_list("invalid_reasons"),
                   f.opt_number("client_cpu_utilization"), f.opt_integer("num_client_side_errors"),
                   f.opt_number("send_lag_p99_ms"), f.opt_number("max_send_lag_p99_ms"))


@dataclass(frozen=True)
class RunSummary:
    """summary.json, typed: one run's client metrics, load, validity, server metrics and intervals."""

    identity: RunIdentity
    """What was run and how the load was shaped."""
    num_prompts: int = 0
    """Requests in the measured window."""
    completed: int = 0
    """Of which completed."""
    failed: int = 0
    """Of which failed."""
    cancelled: int = 0
    """Of which cancelled by the client."""
    totals: RunTotals = RunTotals()
    """Duration (s), token totals, throughputs (per second of the duration)."""
    latency: Mapping[str, float | None] = field(default_factory=dict)
    """latency_keys() -> ms, over completed requests (None: no data)."""
    error_rate: float = 0.0
    """failed / (sent - cancelled)."""
    goodput: float | None = None
    """Completed req/s meeting every per-request bound (None: no bound given)."""
    slo: Mapping[str, float | None] = field(default_factory=dict)
    """The per-request bounds goodput used (ms)."""
    errors_by_kind: Mapping[str, int] = field(default_factory=dict)
    """Failed requests by error kind (http_503, timeout, ...)."""
    per_class: Mapping[str, ClassSummary] = field(default_factory=dict)
    """Trace class -> its summary."""
    validity: Validity = Validity()
    """Whether the run counts."""
    server: ServerSummary = field(default_factory=ServerSummary)
    """What the server's /metrics said over the run."""
    ci: Mapping[str, Interval] = field(default_factory=dict)
    """Summary key -> its interval (run_stats.py)."""
    fixed: Mapping[str, JSON] = field(default_factory=dict)
    """The fixed things (fixed.py): model, GPU, versions, trace."""
    num_sent: int | None = None
    """Requests sent, warm-up and cool-down included."""
    window: Mapping[str, JSON] = field(default_factory=dict)
    """The steady-state window (window.py)."""
    load_client: Mapping[str, JSON] = field(default_factory=dict)
    """summary["client"]: what the load generator did and cost (load_summary.py)."""
    num_sessions: int | None = None
    """Sessions, for a trace with sessions."""
    per_turn: Mapping[str, ClassSummary] = field(default_factory=dict)
    """Session turn index -> its summary."""
    retries: RetrySummary | None = None
    """Retries, when --retry was on."""
    cache: CacheSummary = field(default_factory=CacheSummary)
    """The prefix-cache state the run had and the hit rate it measured (mode 'unknown' for older runs)."""
    simulated: Simulated | None = None
    """Set when the simulator wrote the run (None: measured on a server)."""
    schema_version: int = SCHEMA_VERSION
    """Layout version of the file it came from."""
    extra: Mapping[str, JSON] = field(default_factory=dict)
    """Keys this code does not know, kept for the round trip."""

    @property
    def label(self) -> str:
        return self.identity.label

    @property
    def request_rate(self) -> float:
        return self.identity.request_rate

    @property
    def valid(self) -> bool:
        return self.validity.valid

    @property
    def duration(self) -> float:
        return self.totals.duration or 0.0

    @property
    def request_throughput(self) -> float:
        return self.totals.request_throughput or 0.0

    def metric(self, name: str) -> float | None:
        """A numeric key by its summary.json name, looking into `server` for the server's (sweeps and
        reports name metrics by these keys)."""
        own: dict[str, float | None] = {**self.totals.as_dict(), **self.latency, "error_rate": self.error_rate,
                                        "goodput": self.goodput, "num_prompts": float(self.num_prompts),
                                        "completed": float(self.completed), "failed": float(self.failed),
                                        "cancelled": float(self.cancelled),
                                        "send_lag_p99_ms": self.validity.send_lag_p99_ms,
                                        "client_cpu_utilization": self.validity.client_cpu_utilization}
        return own[name] if name in own else self.server.value(name)


def _classes(f: Fields) -> dict[str, ClassSummary]:
    return {name: ClassSummary.from_json(c) for name, c in f.children().items()}


def summary_from_json(data: JSON, default_label: str, where: str) -> RunSummary:
    """A summary.json of any schema version so far; `where` (the file) is named in any error."""
    f = Fields.of(data, where)
    retries = f.child("retries")
    return RunSummary(
        identity=RunIdentity.from_json(f, default_label), **{k: f.integer(k) for k in _COUNTS},
        totals=RunTotals.from_json(f),
        latency={k: f.opt_number(k) for k in latency_keys() if k in f.data},
        error_rate=f.number("error_rate"), goodput=f.opt_number("goodput"),
        slo=f.child("slo").numbers(), errors_by_kind={k: int(v or 0) for k, v in f.child("errors_by_kind").numbers().items()},
        per_class=_classes(f.child("per_class")), validity=Validity.from_json(f),
        server=ServerSummary.from_json(f.child("server")), ci=intervals_from(f.child("ci")),
        fixed=dict(f.child("fixed").data), num_sent=f.opt_integer("num_sent"), window=dict(f.child("window").data),
        load_client=dict(f.child("client").data), num_sessions=f.opt_integer("num_sessions"),
        per_turn=_classes(f.child("per_turn")),
        retries=RetrySummary.from_json(retries) if retries.data else None,
        cache=CacheSummary.from_json(f.child("cache")), simulated=Simulated.from_json(f.child("simulated")),
        schema_version=f.integer("schema_version", SCHEMA_VERSION),
        extra={k: v for k, v in f.data.items() if k not in _KNOWN})


def _validity_json(v: Validity) -> dict[str, JSON]:
    return {"send_lag_p99_ms": v.send_lag_p99_ms, "max_send_lag_p99_ms": v.max_send_lag_p99_ms,
            "valid": v.valid, "invalid_reason": v.invalid_reason, "invalid_reasons": list(v.invalid_reasons),
            "client_cpu_utilization": v.client_cpu_utilization, "num_client_side_errors": v.num_client_side_errors}


def summary_to_json(s: RunSummary) -> dict[str, JSON]:
    """summary.json's object (the inverse of summary_from_json)."""
    out: dict[str, JSON] = {"schema_version": s.schema_version, **s.identity.to_json(),
                            "num_prompts": s.num_prompts, "completed": s.completed, "failed": s.failed,
                            "cancelled": s.cancelled, **s.totals.as_dict(), **s.latency, "slo": dict(s.slo),
                            "goodput": s.goodput, "error_rate": s.error_rate,
                            "errors_by_kind": dict(s.errors_by_kind),
                            "per_class": {k: c.to_json() for k, c in s.per_class.items()}}
    if s.num_sent is not None:
        out.update(num_sent=s.num_sent, window=dict(s.window), client=dict(s.load_client))
    if s.per_turn:
        out.update(num_sessions=s.num_sessions, per_turn={k: c.to_json() for k, c in s.per_turn.items()})
    out.update(_validity_json(s.validity), server=s.server.to_json(), ci=intervals_to_json(s.ci), fixed=dict(s.fixed))
    if s.retries is not None:
        out["retries"] = s.retries.to_json()
    out["cache"] = s.cache.to_json()
    if s.simulated is not None:
        out["simulated"] = s.simulated.to_json()
    return {**out, **s.extra}
