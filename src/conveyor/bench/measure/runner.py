"""One benchmark run: trace + load shape + server -> a run directory (docs/RUNDIR contract).

run_benchmark() reads and verifies the trace, resolves the load profile, precomputes every due time,
asks the server who it is, isolates the run's prefix cache (a per-run cache_salt) or warms it on purpose
(load/cache_mode.py), scrapes /metrics before the first request, drives the load (in this process,
or split over --workers processes) while sampling gauges, scrapes again after the last request ends,
and writes command.txt, config.json, server.json, requests.jsonl, server_timeseries.jsonl and
summary.json. Only requests inside the steady-state window (window.py) count in the summary.
Nothing the server does makes it raise: failures are data.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import json
import math
import pathlib
import shlex
import sys
import urllib.parse
from dataclasses import dataclass
from typing import Any, Protocol

from conveyor.bench.jsonvalue import JSON, Fields, JSONObject
from conveyor.bench.load.cache_mode import CacheMode, CacheSaltRefused, new_salt, probe_salt, warm_pass
from conveyor.bench.load.client import ClientConfig, Endpoint, RequestRecord
from conveyor.bench.load.loadgen import LoadPlan, new_session
from conveyor.bench.load.profiles import LoadFlags, LoadProfile, LoadShape, resolve_load
from conveyor.bench.load.retry import RetryLog, RetryPolicy, new_retrying_session
from conveyor.bench.load.workers import run_async
from conveyor.bench.measure.cache_summary import CacheSummary, cache_summary, hit_rate_cell
from conveyor.bench.measure.fixed import ServerView, collect_fixed
from conveyor.bench.measure.load_summary import LoadOutcome, drive, load_fields, load_validity
from conveyor.bench.measure.metrics import GoodputBounds, client_summary
from conveyor.bench.measure.run_record import RunContext, with_run_record
from conveyor.bench.measure.step_log import StepLogCollector, write_step_log
from conveyor.bench.measure.server_metrics import (
    ServerObservation,
    ServerScraper,
    config_info,
    get_json,
    nvml_reading,
    server_summary,
)
from conveyor.bench.measure.summary import SCHEMA_VERSION, RunSummary, summary_from_json, summary_to_json
from conveyor.bench.measure.validity import ClientCpuMeter, ValidityBounds
from conveyor.bench.measure.window import WindowConfig, apply_window
from conveyor.bench.trace.arrivals import ArrivalProcess, send_offsets_s
from conveyor.bench.trace.prefix_share import DEFAULT_BLOCK_SIZE, expected_hit_rate
from conveyor.bench.trace.traces import Trace, TraceError, TraceRequest, dispatch_units, read_trace
from conveyor.bench.units import fmt_bytes


class BenchError(ValueError):
    """A run that cannot start (bad URL, unreachable server, no model): the message names the flag."""


@dataclass(frozen=True, kw_only=True)
class BenchRunConfig:
    """`conveyor bench run` options, one field per flag."""

    base_url: str
    """Server root URL (http://host:port)."""
    trace_path: str
    """Trace file (conveyor trace make / import)."""
    out_dir: str
    """Run directory to write."""
    request_rate: float = math.inf
    """Offered requests (dispatch units: standalone requests and session starts) per second; math.inf: all due at once."""
    label: str = ""
    """Name of the run in tables (default: the out_dir's name)."""
    profile: str | None = None
    """synchronous | concurrent | throughput | constant | poisson (GuideLLM's names; None: the flags decide)."""
    max_concurrency: int | None = None
    """At most this many requests in flight (vLLM's --max-concurrency; None: open loop)."""
    burstiness: float = 1.0
    """Gamma shape k (gamma arrival)."""
    arrival: str | None = None
    """poisson | gamma | constant | replay (None: poisson, or what the profile says)."""
    time_scale: float = 1.0
    """replay: trace seconds per wall second."""
    endpoint: str = "completions"
    """completions | chat."""
    temperature: float | None = None
    """Sent with every request (vllm bench serve's --temperature; None: left to the server, 1.0 unless set)."""
    model: str | None = None
    """Model name to request (default: the first of GET /v1/models)."""
    seed: int = 0
    """Arrival seed."""
    max_send_lag_p99_ms: float = 10.0
    """The run is invalid if the p99 send lag exceeds this."""
    request_timeout_s: float = 600.0
    """Per-request timeout."""
    scrape_interval_s: float = 1.0
    """Gauge sampling period for server_timeseries.jsonl."""
    slo: PerRequestBounds | None = None
    """Per-request bounds for goodput: GoodputBounds, or bench/decide/slo.py's SLO (it has the same fields)."""
    api_key: str | None = None
    """Bearer token for the server."""
    num_requests: int | None = None
    """Send only the first N requests of the trace."""
    duration_s: float | None = None
    """Seconds of arrivals: the first ceil(request_rate × duration_s) trace requests (num_requests wins)."""
    warmup_requests: int = 0
    """The first N requests sent are warm-up: recorded, not summarized."""
    warmup_s: float = 0.0
    """Requests sent in the first S seconds are warm-up."""
    cooldown_requests: int = 0
    """The last N requests sent are cool-down: recorded, not summarized."""
    cooldown_s: float = 0.0
    """Requests sent in the last S seconds of dispatch are cool-down."""
    num_workers: int = 1
    """Load-generator processes (--workers); the schedule is split across them."""
    show_progress: bool = True
    """Progress line on stderr."""
    command: str | None = None
    """The command line to record in command.txt (default: this process's argv)."""
    max_client_cpu: float = 0.9
    """The run is invalid if the benchmark process used this much of a core or more."""
    retry: RetryPolicy | None = None
    """Retry 503s honouring Retry-After (None: off)."""
    cache_mode: str = CacheMode.ISOLATED.value
    """isolated (a per-run cache_salt: no run hits an earlier run's blocks) | warm (no salt, a warm-up pass
    replaying the trace's prompts first): load/cache_mode.py."""
    collect_step_log: bool = False
    """Write the server's step log for the run as step_log.jsonl (bench/measure/step_log.py), if it offers one."""

    def __post_init__(self) -> None:
        parts = urllib.parse.urlsplit(self.base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise BenchError(f"--base-url {self.base_url!r} must look like http://HOST:PORT")
        if self.arrival is not None and self.arrival not in {a.value for a in ArrivalProcess}:
            raise BenchError(f"--arrival {self.arrival!r} must be one of poisson, gamma, constant, replay")
        if self.profile is not None and self.profile not in {p.value for p in LoadProfile}:
            raise BenchError(f"--profile {self.profile!r} must be one of {', '.join(p.value for p in LoadProfile)}")
        if self.cache_mode not in {m.value for m in CacheMode}:
            raise BenchError(f"--cache-mode {self.cache_mode!r} must be isolated or warm")
        if self.endpoint not in {e.value for e in Endpoint}:
            raise BenchError(f"--endpoint {self.endpoint!r} must be completions or chat")
        if self.temperature is not None and not self.temperature >= 0:
            raise BenchError(f"--temperature must be >= 0, got {self.temperature}")
        if not self.request_rate > 0:
            raise BenchError(f"--rate must be > 0 or inf, got {self.request_rate}")
        if self.num_requests is not None and self.num_requests < 1:
            raise BenchError("--num-requests must be >= 1")
        if self.duration_s is not None and not (self.duration_s > 0 and math.isfinite(self.request_rate)):
            raise BenchError(f"--duration must be > 0 s with a finite --rate, got {self.duration_s}")
        if self.request_timeout_s <= 0 or self.scrape_interval_s <= 0 or self.max_send_lag_p99_ms <= 0:
            raise BenchError("--request-timeout-s, --scrape-interval-s and --max-send-lag-ms must be > 0")
        if self.num_workers < 1:
            raise BenchError(f"--workers must be >= 1, got {self.num_workers}")
        try:
            self.load_shape()
            self.window()
        except ValueError as exc:
            raise BenchError(str(exc)) from exc

    def num_to_send(self) -> int | None:
        """How many of the trace's first requests this run sends (None: all of them)."""
        if self.num_requests is not None:
            return self.num_requests
        if self.duration_s is not None:
            return max(1, math.ceil(self.request_rate * self.duration_s))
        return None

    def load_shape(self) -> LoadShape:
        """The arrival process and concurrency cap the flags ask for."""
        return resolve_load(LoadFlags(
            profile=None if self.profile is None else LoadProfile(self.profile), request_rate=self.request_rate,
            arrival=None if self.arrival is None else ArrivalProcess(self.arrival),
            max_concurrency=self.max_concurrency, burstiness=self.burstiness, time_scale=self.time_scale,
            seed=self.seed))

    @property
    def run_label(self) -> str:
        return self.label or pathlib.Path(self.out_dir).name

    def window(self) -> WindowConfig:
        return WindowConfig(warmup_requests=self.warmup_requests, warmup_s=self.warmup_s,
                            cooldown_requests=self.cooldown_requests, cooldown_s=self.cooldown_s)


class PerRequestBounds(Protocol):
    """What goodput needs of an objective: its per-request bounds in ms (None: no bound)."""

    @property
    def ttft_ms(self) -> float | None: ...
    @property
    def tpot_ms(self) -> float | None: ...
    @property
    def e2el_ms(self) -> float | None: ...


def goodput_bounds(slo: PerRequestBounds | None) -> GoodputBounds | None:
    if slo is None or isinstance(slo, GoodputBounds):
        return slo
    # An objective bounds ITL only as a p95 over the run, never per request: no per-request ITL bound.
    return GoodputBounds(ttft_ms=slo.ttft_ms, tpot_ms=slo.tpot_ms, e2el_ms=slo.e2el_ms)


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _jsonable(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return value


def run_benchmark(cfg: BenchRunConfig) -> RunSummary:
    """Run the benchmark, write cfg.out_dir, return the summary dict."""
    trace = read_trace(cfg.trace_path)
    count = cfg.num_to_send()
    requests = trace.requests[:count] if count else trace.requests
    shape = cfg.load_shape()
    try:
        units = dispatch_units(requests)
        offsets = send_offsets_s(shape.arrival, len(units), [u[0].arrival_s for u in units])
    except (ValueError, TraceError) as exc:
        raise BenchError(str(exc)) from exc
    if cfg.warmup_requests + cfg.cooldown_requests >= len(requests):
        raise BenchError(f"--warmup-requests {cfg.warmup_requests} + --cooldown-requests {cfg.cooldown_requests} "
                         f"leave none of the {len(requests)} requests to measure")
    plan = LoadPlan(units=units, offsets_s=offsets, max_concurrency=shape.max_concurrency)
    return run_async(_run(cfg, trace, plan))


@dataclass(frozen=True)
class ServerIdentity:
    """server.json: who the server said it was (each answer as it came; null when the endpoint failed)."""

    models: JSON
    """GET /v1/models."""
    version: JSON
    """GET /version."""
    config_info: dict[str, str] = dataclasses.field(default_factory=dict)
    """Its engine configuration labels (vLLM's cache_config_info), scraped after the run."""

    def to_json(self) -> JSONObject:
        return {"models": self.models, "version": self.version, "config_info": dict(self.config_info)}


async def _identify(cfg: BenchRunConfig, session: Any) -> tuple[str, ServerIdentity]:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    root = cfg.base_url.rstrip("/")
    models = await get_json(session, f"{root}/v1/models", headers)
    version = await get_json(session, f"{root}/version", headers)
    model = cfg.model
    if model is None:
        # Any, not JSON: a listing of another shape fails loudly on the index, as it always did
        data: Any = Fields.of(models, f"{root}/v1/models").raw("data") if isinstance(models, dict) else None
        if not data:
            raise BenchError(f"--model not given and {root}/v1/models listed no model (is the server up?)")
        model = str(data[0]["id"])
    return model, ServerIdentity(models, version)


async def _run(cfg: BenchRunConfig, trace: Trace, plan: LoadPlan) -> RunSummary:
    retry_log = RetryLog()
    session_cm = new_retrying_session(cfg.retry, retry_log) if cfg.retry is not None else new_session()
    async with session_cm as session:
        model, identity = await _identify(cfg, session)
        isolated = cfg.cache_mode == CacheMode.ISOLATED.value
        client = ClientConfig(base_url=cfg.base_url, model=model, endpoint=Endpoint(cfg.endpoint),
                              api_key=cfg.api_key, request_timeout_s=cfg.request_timeout_s,
                              temperature=cfg.temperature, cache_salt=new_salt(cfg.run_label) if isolated else None)
        num_warm = await _prepare_cache(session, client, [r for unit in plan.units for r in unit])
        scraper = ServerScraper(session, cfg.base_url, cfg.scrape_interval_s)
        await scraper.start()
        sampler = asyncio.create_task(scraper.run())
        started_at = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        steps = StepLogCollector(session, cfg.base_url, cfg.api_key)
        if cfg.collect_step_log:
            await steps.start()
        meter = ClientCpuMeter()  # this process only: --workers processes are gated by their send lag
        try:
            load = await drive(session, client, plan, cfg.num_workers, cfg.show_progress)
        finally:
            sampler.cancel()
            step_rows = await steps.stop()
        cpu = meter.stop()
        obs = await scraper.stop()
    identity = dataclasses.replace(identity, config_info=config_info(obs.after or obs.before))
    view = ServerView(identity.models, identity.version, obs.after or obs.before, scraper.local,
                      nvml_reading() if scraper.local else None)
    context = RunContext(client_cpu=cpu, fixed=collect_fixed(view, identity.config_info, cfg.trace_path),
                         retry_policy=cfg.retry, retry_log=retry_log, cache_salt=client.cache_salt,
                         num_warm_pass=num_warm)
    summary = build_summary(cfg, trace, model, (load, obs, started_at), context)
    write_run_dir(cfg, identity, load, obs, summary)
    write_step_log(pathlib.Path(cfg.out_dir), step_rows)
    return summary


async def _prepare_cache(session: Any, client: ClientConfig, requests: list[TraceRequest]) -> int:
    """Isolated: check the server takes the salt (0). Warm: replay the prompts once (how many were sent).
    Both before the "before" scrape, so the server's counters over the run exclude them."""
    if client.cache_salt is None:
        return await warm_pass(session, client, requests)
    try:
        await probe_salt(session, client)
    except CacheSaltRefused as exc:
        raise BenchError(str(exc)) from exc
    return 0


def _cache(cfg: BenchRunConfig, trace: Trace, measured: list[RequestRecord], obs: ServerObservation,
           context: RunContext, server_rate: float | None) -> CacheSummary:
    """The trace's own sharing is rounded to the server's block size (its cache_config_info, else 16)."""
    count = cfg.num_to_send()
    sent = trace.requests[:count] if count else trace.requests
    block = Fields(config_info(obs.after or obs.before), "cache_config_info").text("block_size")
    expected = expected_hit_rate(sent, int(block) if block.isdigit() else DEFAULT_BLOCK_SIZE)
    return cache_summary(cfg.cache_mode, context.cache_salt, measured, server_rate, expected, context.num_warm_pass)


def _measured(cfg: BenchRunConfig, trace: Trace, model: str, run: tuple[LoadOutcome, ServerObservation, str],
              bounds: GoodputBounds | None) -> tuple[RunSummary, list[RequestRecord]]:
    """What the client, the load generator and the server's /metrics measured, typed once (each piece is the
    summary.json object its module computes and its tests assert on, read by the file's own reader), and
    the records inside the steady-state window."""
    load, obs, started_at = run
    shape = cfg.load_shape()
    window = apply_window(load.records, cfg.window())  # marks each record in or out of the window
    measured = [r for r in load.records if r.in_window]
    summary: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION, "label": cfg.run_label,
        "base_url": cfg.base_url, "model": model, "endpoint": cfg.endpoint,
        "temperature": cfg.temperature, "trace_path": cfg.trace_path,
        "trace_version": trace.header.version, "request_rate": _jsonable(cfg.request_rate),
        "burstiness": cfg.burstiness, "arrival": shape.arrival.process.value, "profile": cfg.profile,
        "max_concurrency": shape.max_concurrency, "seed": cfg.seed, "started_at": started_at,
    }
    summary.update(client_summary(measured, bounds))
    summary.update(load_fields(load, measured, window))
    valid, reason = load_validity(load, window, cfg.max_send_lag_p99_ms)
    summary.update({"max_send_lag_p99_ms": cfg.max_send_lag_p99_ms, "valid": valid, "invalid_reason": reason,
                    "server": server_summary(obs)})
    return summary_from_json(summary, cfg.run_label, "the run's summary"), measured


def build_summary(cfg: BenchRunConfig, trace: Trace, model: str,
                  run: tuple[LoadOutcome, ServerObservation, str], context: RunContext | None = None) -> RunSummary:
    bounds = goodput_bounds(cfg.slo)
    context = context or RunContext()
    summary, measured = _measured(cfg, trace, model, run, bounds)
    summary = with_run_record(summary, measured, bounds, ValidityBounds(cfg.max_client_cpu), context)
    server_rate = summary.server.value("prefix_cache_hit_rate")
    return dataclasses.replace(summary, cache=_cache(cfg, trace, measured, run[1], context, server_rate))


def _write_jsonl(path: pathlib.Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def write_run_dir(cfg: BenchRunConfig, identity: ServerIdentity, load: LoadOutcome, obs: ServerObservation,
                  summary: RunSummary) -> None:
    out = pathlib.Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "command.txt").write_text((cfg.command or shlex.join(sys.argv)) + "\n", encoding="utf-8")
    (out / "config.json").write_text(json.dumps(_jsonable(cfg), indent=2, default=str) + "\n", encoding="utf-8")
    (out / "server.json").write_text(json.dumps(identity.to_json(), indent=2) + "\n", encoding="utf-8")
    _write_jsonl(out / "requests.jsonl", [r.to_json() for r in load.records])
    _write_jsonl(out / "server_timeseries.jsonl", [
        {"t_s": round(s.t_abs - load.t0, 6), "num_requests_running": s.num_requests_running,
         "num_requests_waiting": s.num_requests_waiting, "kv_cache_usage_perc": s.kv_cache_usage_perc}
        for s in obs.samples])
    (out / "summary.json").write_text(json.dumps(summary_to_json(summary), indent=2) + "\n", encoding="utf-8")


DASHBOARD_COLUMNS = ("Run", "Offered req/s", "Completed req/s", "TTFT p95", "Queue p95", "E2E p95",
                     "Error rate", "Preemptions", "Peak memory", "Prefix-cache hits")


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def dashboard_row(s: RunSummary) -> list[str]:
    server, cap = s.server, s.identity.max_concurrency
    rate = "inf" if math.isinf(s.request_rate) else _fmt(s.request_rate, 2)
    offered = rate + (f" (<= {cap} in flight)" if cap else "")
    row = [s.label + ("" if s.valid else " (INVALID)"), offered,
           _fmt(s.request_throughput, 2), _fmt(s.metric("p95_ttft_ms")) + " ms",
           _fmt(server.value("queue_time_p95_ms")) + " ms", _fmt(s.metric("p95_e2el_ms")) + " ms",
           f"{100.0 * s.error_rate:.1f}%", _fmt(server.value("num_preemptions"), 0),
           fmt_bytes(server.value("peak_gpu_memory_bytes")), hit_rate_cell(s.cache)]
    return [c.replace("- ms", "-") for c in row]


def dashboard_table(summaries: list[RunSummary]) -> str:
    """The guide's dashboard row(s) as a plain-text table."""
    rows = [list(DASHBOARD_COLUMNS)] + [dashboard_row(s) for s in summaries]
    widths = [max(len(r[i]) for r in rows) for i in range(len(DASHBOARD_COLUMNS))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)
