"""Open-loop load generation: send each request at its scheduled time, whatever the server is doing.

All send times are computed before the run (arrivals.py). The dispatcher sleeps until each one
(asyncio.sleep until ~1 ms before, then yields in a tight loop so other tasks keep streaming) and starts
the request as its own task; it never waits for an earlier request to finish, so a slow server sees a
growing queue, as in production, instead of a politely slowed client (closed-loop benchmarks hide
overload). Each record keeps scheduled and actual send times: the lag between them is the client's own
error, and runner.py marks a run invalid when its p99 exceeds the bound.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from conveyor.bench.client import ClientConfig, RequestRecord, RequestStatus, prepare, send_request
from conveyor.bench.traces import TraceRequest

SPIN_S = 0.001  # the last millisecond before a send is spent yielding, not sleeping (timer granularity)


@dataclass
class LoadResult:
    """What the dispatcher produced."""

    records: list[RequestRecord]
    """One per dispatched request, in trace order."""
    t0: float
    """perf_counter() at the run start; every *_s in the records is relative to it."""


def new_session(num_connections: int = 0) -> aiohttp.ClientSession:
    """Unlimited connections (an open loop must not queue in the client); timeouts are per request."""
    connector = aiohttp.TCPConnector(limit=num_connections, ttl_dns_cache=300)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))


async def sleep_until(deadline: float) -> None:
    """Sleep until perf_counter() >= deadline, to ~tens of µs when the loop is idle."""
    while True:
        delay = deadline - time.perf_counter()
        if delay <= 0:
            return
        await asyncio.sleep(delay - SPIN_S if delay > 2 * SPIN_S else 0)


class Progress:
    """One-line progress on stderr (sent/completed/cancelled/failed), redrawn at most twice a second."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.sent = total, enabled, 0
        self.records: list[RequestRecord] = []
        self._t_start = time.perf_counter()

    def draw(self, final: bool = False) -> None:
        if not self.enabled:
            return
        done = [r.status for r in self.records if r.end_s is not None]
        line = (f"\r[bench] sent {self.sent}/{self.total}  completed {done.count(RequestStatus.COMPLETED)}  "
                f"cancelled {done.count(RequestStatus.CANCELLED)}  failed {done.count(RequestStatus.FAILED)}  "
                f"{time.perf_counter() - self._t_start:6.1f} s")
        sys.stderr.write(line + ("\n" if final else ""))
        sys.stderr.flush()

    async def run(self) -> None:
        while True:
            self.draw()
            await asyncio.sleep(0.5)


async def run_open_loop(session: aiohttp.ClientSession, cfg: ClientConfig, requests: Sequence[TraceRequest],
                        offsets_s: Sequence[float], show_progress: bool = True) -> LoadResult:
    """Dispatch requests[i] at t0 + offsets_s[i]; return when every request has ended."""
    if len(requests) != len(offsets_s):
        raise ValueError("one send offset per request is required")
    prepared = [prepare(cfg, r) for r in requests]  # encode every body before the clock starts
    progress = Progress(len(requests), show_progress)
    ticker = asyncio.create_task(progress.run())
    tasks: list[asyncio.Task[RequestRecord]] = []
    t0 = time.perf_counter()
    try:
        for p, offset in zip(prepared, offsets_s):
            await sleep_until(t0 + offset)
            rec = RequestRecord(request_id=p.req.request_id, request_class=p.req.request_class, scheduled_s=offset)
            progress.records.append(rec)
            tasks.append(asyncio.create_task(send_request(session, cfg, p, rec, t0)))
            progress.sent += 1
        records = list(await asyncio.gather(*tasks))
    finally:
        ticker.cancel()
        for task in tasks:
            task.cancel()
    progress.draw(final=True)
    return LoadResult(records=records, t0=t0)
