"""The load side of a run: drive a plan (one process or --workers), then the summary keys that describe the
load generator itself (send lag per worker, client CPU, concurrency reached, client queueing, window,
sessions and per-turn results) and whether it kept up. The latency and throughput keys are metrics.py's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from conveyor.bench.load.client import JSON_LIBRARY, ClientConfig, RequestRecord
from conveyor.bench.load.loadgen import LoadPlan, Progress, run_load
from conveyor.bench.load.workers import WorkerPool, WorkerStats, split_plan
from conveyor.bench.measure.metrics import class_summary, duration_s, validity


@dataclass
class LoadOutcome:
    """Every request's record and what each load-generator process cost."""

    records: list[RequestRecord]
    """All requests sent (warm-up and cool-down included), in plan order: the trace's order, a session's
    turns together at its first turn's place."""
    t0: float
    """This process's perf_counter() at the common start; record times are relative to it."""
    workers: list[WorkerStats] = field(default_factory=list)
    """One per load-generator process."""
    event_loop: str = "asyncio"
    """The event loop the load ran on (uvloop when installed)."""


async def drive(session: aiohttp.ClientSession, cfg: ClientConfig, plan: LoadPlan, num_workers: int,
                show_progress: bool) -> LoadOutcome:
    """Run the plan here (one worker) or split over num_workers spawned processes."""
    loop = type(asyncio.get_running_loop()).__module__.split(".")[0]  # uvloop or asyncio, as in the workers
    order = {r.request_id: i for i, r in enumerate(r for unit in plan.units for r in unit)}
    if num_workers == 1:
        cpu0 = time.process_time()
        progress = Progress(plan.num_requests, show_progress, max(plan.offsets_s, default=0.0))
        result = await run_load(session, cfg, plan, progress=progress)
        stats = [WorkerStats(worker=0, num_requests=len(result.records), cpu_s=time.process_time() - cpu0)]
        records, t0 = result.records, result.t0
    else:
        pool = WorkerPool(cfg, split_plan(plan, num_workers), show_progress)
        pool.start()
        starts: list[float] = []
        records, stats = await pool.run(starts.append)
        t0 = starts[0]
    records.sort(key=lambda r: order[r.request_id])
    return LoadOutcome(records=records, t0=t0, workers=stats, event_loop=loop)


def lag_p99_ms(records: Sequence[RequestRecord]) -> float:
    return float(np.percentile([r.send_lag_s for r in records], 99)) * 1000.0 if records else 0.0


def peak_in_flight(records: Sequence[RequestRecord]) -> int:
    """Most requests between their send and their end at one instant (ends sort before sends at a tie)."""
    events = sorted([(r.sent_s, 1) for r in records] + [(r.end_s, -1) for r in records if r.end_s is not None])
    peak = current = 0
    for _, step in events:
        current += step
        peak = max(peak, current)
    return peak


def _ms_percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None}
    p50, p99 = np.percentile(np.asarray(values) * 1000.0, [50, 99])
    return {"p50": float(p50), "p99": float(p99)}


def client_fields(load: LoadOutcome) -> dict[str, Any]:
    """What the load generator did and cost (summary["client"])."""
    cpu_s = sum(w.cpu_s for w in load.workers)
    queue = _ms_percentiles([r.client_queue_s for r in load.records])
    return {
        "num_workers": len(load.workers), "cpu_s_per_worker": [round(w.cpu_s, 4) for w in load.workers],
        "cpu_ms_per_request": 1000.0 * cpu_s / len(load.records) if load.records else None,
        "send_lag_p99_ms_per_worker": [lag_p99_ms([r for r in load.records if r.worker == w.worker])
                                       for w in load.workers],
        "peak_in_flight": peak_in_flight(load.records),
        "client_queue_p50_ms": queue["p50"], "client_queue_p99_ms": queue["p99"],
        "json": JSON_LIBRARY, "event_loop": load.event_loop,
    }


def turn_fields(measured: list[RequestRecord]) -> dict[str, Any]:
    """Sessions and per-turn results (turn index -> the per-class keys plus the mean prompt tokens sent)."""
    turns = sorted({r.turn for r in measured if r.turn is not None})
    if not turns:
        return {}
    dur = duration_s(measured)
    per_turn: dict[str, Any] = {}
    for k in turns:
        of_turn = [r for r in measured if r.turn == k]
        entry = class_summary(of_turn, dur)
        entry["mean_prompt_tokens"] = float(np.mean([r.prompt_tokens for r in of_turn]))
        per_turn[str(k)] = entry
    return {"num_sessions": len({r.session_id for r in measured if r.turn is not None}), "per_turn": per_turn}


def load_fields(load: LoadOutcome, measured: list[RequestRecord], window: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"num_sent": len(load.records), "send_lag_p99_ms": lag_p99_ms(load.records),
                           "window": window, "client": client_fields(load)}
    out.update(turn_fields(measured))
    return out


def load_validity(load: LoadOutcome, window: dict[str, Any], bound_ms: float) -> tuple[bool, str | None]:
    """Invalid if any worker's p99 send lag exceeds the bound, or the window measured nothing."""
    for w in load.workers:
        valid, reason = validity(lag_p99_ms([r for r in load.records if r.worker == w.worker]), bound_ms)
        if not valid:
            return False, reason if len(load.workers) == 1 else f"worker {w.worker}: {reason}"
    if window["num_measured"] == 0:
        return False, "no request was sent inside the steady-state window (shorten --warmup-s / --cooldown-s)"
    return True, None
