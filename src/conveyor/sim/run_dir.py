"""A replay's outcome as a run directory in `conveyor bench run`'s format, marked simulated.

Each simulated request becomes the `RequestRecord` the client would have written (TTFT, ITL, E2E from its
chunk times after its send; the wait for a --max-concurrency slot as client_queue_s; no send lag: the
simulated client is never late), and the summary is computed from those
records by bench's own code (`metrics.client_summary`, `load_summary.turn_fields`, `run_record.with_run_record`,
`cache_summary`), so a simulated number means exactly what the measured one does. The server half comes
from the engine's own counters (preemptions, prefix-cache hits, token totals) and its gauges sampled over
the replay (server_timeseries.jsonl). `simulated` in summary.json says what priced the steps;
`conveyor report` marks such runs.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import math
import pathlib
from dataclasses import dataclass, field
from typing import Any

from conveyor.bench.jsonvalue import JSON
from conveyor.bench.load.cache_mode import CacheMode
from conveyor.bench.load.client import ErrorKind, RequestRecord, RequestStatus
from conveyor.bench.measure.cache_summary import cache_summary
from conveyor.bench.measure.load_summary import turn_fields
from conveyor.bench.measure.metrics import client_summary
from conveyor.bench.measure.run_record import RunContext, with_run_record
from conveyor.bench.measure.summary import (
    SCHEMA_VERSION,
    RunSummary,
    Simulated,
    summary_from_json,
    summary_to_json,
)
from conveyor.bench.measure.validity import ValidityBounds
from conveyor.bench.measure.window import WindowConfig, apply_window
from conveyor.bench.trace.prefix_share import expected_hit_rate
from conveyor.bench.trace.traces import Trace
from conveyor.core.simulate import percentile
from conveyor.core.trace_sim import SimOutcome, TraceSimResult
from conveyor.file_digest import file_sha256
from conveyor.sim.engine_setup import EngineSetup, server_flags
from conveyor.sim.workload import LoadSettings

SERVER_NAME = "conveyor-simulate"
"""fixed.server_name of a simulated run: never mistaken for a measured conveyor or vLLM server."""
_HTTP_STATUS = {ErrorKind.HTTP_4XX: 400, ErrorKind.HTTP_503: 503, ErrorKind.HTTP_5XX: 500}


@dataclass(frozen=True)
class SimRunSpec:
    """What was replayed, on what, priced how."""

    label: str
    trace_path: str
    trace: Trace
    load: LoadSettings
    setup: EngineSetup
    simulated: Simulated
    model: str = ""
    """The model the calibration was fitted on (empty: none)."""
    window: WindowConfig = field(default_factory=WindowConfig)
    """Which requests count (a validated run's own warm-up and cool-down; default: all)."""


def request_record(outcome: SimOutcome) -> RequestRecord:
    """What the client would have recorded (latencies as `vllm bench serve` defines them)."""
    chunks, sent_s = outcome.chunk_times_s, outcome.sent_s
    request = outcome.request
    kind = ErrorKind(outcome.error) if outcome.error else None
    completed = outcome.status == RequestStatus.COMPLETED.value
    record = RequestRecord(
        request.request_id, request.request_class, scheduled_s=outcome.scheduled_s, sent_s=sent_s,
        client_queue_s=sent_s - outcome.scheduled_s,
        status=RequestStatus(outcome.status), error_kind=kind,
        http_status=_HTTP_STATUS[kind] if kind is not None else 200, prompt_tokens=outcome.prompt_tokens,
        output_tokens=outcome.output_tokens, ttft_s=chunks[0] - sent_s if chunks else None,
        itl_s=[later - earlier for earlier, later in itertools.pairwise(chunks)],
        e2e_s=chunks[-1] - sent_s if completed and chunks else None, end_s=outcome.end_s,
        session_id=request.session_id, turn=request.turn, cached_tokens=outcome.cached_tokens)
    if completed and record.e2e_s is not None and record.output_tokens > 1:
        record.tpot_s = (record.e2e_s - (record.ttft_s or 0.0)) / (record.output_tokens - 1)
    return record


def server_values(result: TraceSimResult) -> dict[str, Any]:
    """summary.json's `server` object from the engine's counters and gauges (server_metrics.py's keys)."""
    queue_ms = [o.queue_s * 1000.0 for o in result.outcomes if o.queue_s is not None]
    kv = [s.kv_cache_usage_perc for s in result.samples]
    return {
        "available": True, **{f"queue_time_p{q}_ms": percentile(queue_ms, q) if queue_ms else None
                              for q in (50, 95, 99)},
        "num_preemptions": result.num_preemptions,
        "prefix_cache_hit_rate": (result.prefix_cache_hits / result.prefix_cache_queries
                                  if result.prefix_cache_queries else None),
        "generation_tokens": result.generation_tokens, "prompt_tokens": result.prompt_tokens,
        "kv_cache_usage_max": max(kv, default=None), "kv_cache_usage_mean": sum(kv) / len(kv) if kv else None,
        "num_requests_waiting_max": max((s.num_requests_waiting for s in result.samples), default=None),
        "num_requests_running_max": max((s.num_requests_running for s in result.samples), default=None)}


def _identity(spec: SimRunSpec) -> dict[str, Any]:
    load = spec.load
    return {"schema_version": SCHEMA_VERSION, "label": spec.label, "base_url": "", "model": spec.model,
            "endpoint": "completions", "temperature": 0.0, "trace_path": spec.trace_path,
            "trace_version": spec.trace.header.version,
            "request_rate": "inf" if math.isinf(load.request_rate) else load.request_rate,
            "burstiness": load.burstiness, "arrival": load.shape().arrival.process.value, "profile": load.profile,
            "max_concurrency": load.shape().max_concurrency, "seed": load.seed,
            "started_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}


def build_summary(spec: SimRunSpec, result: TraceSimResult) -> tuple[RunSummary, list[RequestRecord]]:
    """The run's summary, computed from its records as `bench run` computes a measured one."""
    records = sorted((request_record(o) for o in result.outcomes), key=lambda r: (r.sent_s, r.request_id))
    window = apply_window(records, spec.window)
    measured = [r for r in records if r.in_window]
    summary = _identity(spec)
    summary.update(client_summary(measured, None))
    summary.update(num_sent=len(records), send_lag_p99_ms=0.0, window=window, client={"simulated": True},
                   **turn_fields(measured))
    summary.update(max_send_lag_p99_ms=None, valid=True, invalid_reason=None, server=server_values(result))
    trace = pathlib.Path(spec.trace_path)
    flags: dict[str, JSON] = dict(server_flags(spec.setup))
    fixed: dict[str, JSON] = {"server_name": SERVER_NAME,
                              "trace_sha256": file_sha256(trace) if trace.is_file() else None, "server_flags": flags}
    if spec.simulated.gpu_name is not None:  # reports group and price runs by it (bench/measure/gpu_groups.py)
        fixed["gpu_name"] = spec.simulated.gpu_name
    sent_ids = {rec.request_id for rec in records}
    sent = [r for r in spec.trace.requests if r.request_id in sent_ids]
    expected = expected_hit_rate(sent, spec.setup.cache.block_size)
    summary["cache"] = cache_summary(CacheMode.ISOLATED.value, None, measured,
                                     summary["server"]["prefix_cache_hit_rate"], expected).to_json()
    summary["simulated"] = spec.simulated.to_json()
    typed = summary_from_json(summary, spec.label, "the simulated run's summary")
    return with_run_record(typed, measured, None, ValidityBounds(), RunContext(fixed=fixed)), records


def write_run_dir(out_dir: pathlib.Path, spec: SimRunSpec, result: TraceSimResult, command: str) -> RunSummary:
    """command.txt, config.json, requests.jsonl, server_timeseries.jsonl and summary.json, as `bench run`."""
    summary, records = build_summary(spec, result)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "command.txt").write_text(command + "\n", encoding="utf-8")
    config: dict[str, JSON] = {"simulated": spec.simulated.to_json(), "trace_path": spec.trace_path,
                               "server_flags": dict(server_flags(spec.setup)),
                               "num_steps": result.num_steps}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    _write_jsonl(out_dir / "requests.jsonl", [r.to_json() for r in records])
    _write_jsonl(out_dir / "server_timeseries.jsonl", [
        {"t_s": round(s.t_s, 6), "num_requests_running": s.num_requests_running,
         "num_requests_waiting": s.num_requests_waiting, "kv_cache_usage_perc": s.kv_cache_usage_perc}
        for s in result.samples])
    (out_dir / "summary.json").write_text(json.dumps(summary_to_json(summary), indent=2) + "\n", encoding="utf-8")
    return summary


def _write_jsonl(path: pathlib.Path, rows: list[Any]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
