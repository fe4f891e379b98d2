"""Load generation: send each request when it is due, open loop, optionally under a concurrency cap.

All send times are computed before the run (arrivals.py), one per dispatch unit (a standalone request,
or a session whose later turns follow their predecessor's answer: sessions.py). The dispatcher sleeps
until each one (asyncio.sleep until SPIN_S before, then yields in a tight loop so other tasks keep
streaming) and starts the request as its own task; without a cap it never waits for an earlier request
to finish, so a slow server sees a growing queue, as in production, instead of a politely slowed client.
With `--max-concurrency N` (vLLM's flag) a request that is due waits, first come first served, for one
of N slots: rate-limited with a cap, or closed loop when everything is due at once (GuideLLM's
synchronous = 1 slot, concurrent = N). Each record keeps three times: due (scheduled_s), the wait for a
slot (client_queue_s, vLLM's client_queue_time) and the client's own delay after that (send_lag_s).
Only the last is the load generator's error, and runner.py marks a run invalid when its p99 exceeds the
bound. `SlotGate.acquire` returns when the slot it grants fell free, which is what makes that split exact.
"""

from __future__ import annotations

import asyncio
import collections
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from conveyor.bench.load.client import (
    ClientConfig,
    PreparedRequest,
    RequestRecord,
    RequestStatus,
    SendContext,
    prepare,
    send_request,
)
from conveyor.bench.load.sessions import History
from conveyor.bench.trace.traces import TraceRequest

SPIN_S = 0.0002
"""The last 0.2 ms before a send is spent yielding, not sleeping. The loop's timers have ~1 ms granularity
(epoll rounds up to whole ms), so sleeping to the deadline lands ~0.7 ms late on average; spinning the
last 1 ms gave µs precision but cost ~0.5 ms of CPU per send, the client's largest per-request cost (and
all of its time above ~500 req/s). 0.2 ms keeps the typical lag under ~0.5 ms, far below the 10 ms bound."""


@dataclass(frozen=True)
class LoadPlan:
    """What one load generator sends: dispatch units, when each is due, and the concurrency cap."""

    units: Sequence[Sequence[TraceRequest]]
    """Standalone requests (one each) and sessions (their turns in order)."""
    offsets_s: Sequence[float]
    """When each unit is due, seconds from the run start (non-decreasing)."""
    max_concurrency: int | None = None
    """At most this many requests in flight (None: no cap, pure open loop)."""
    worker: int = 0
    """Index of the process running this plan (stamped on its records)."""

    def __post_init__(self) -> None:
        if len(self.units) != len(self.offsets_s):
            raise ValueError("one send offset per dispatch unit is required")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")

    @property
    def num_requests(self) -> int:
        return sum(len(u) for u in self.units)


@dataclass
class LoadResult:
    """What the dispatcher produced."""

    records: list[RequestRecord]
    """One per request sent, in dispatch order (standalone and first turns by due time)."""
    t0: float
    """perf_counter() at the run start; every *_s in the records is relative to it."""


def new_session(num_connections: int = 0) -> aiohttp.ClientSession:
    """Unlimited connections (the cap, if any, is the SlotGate's); timeouts are per request."""
    connector = aiohttp.TCPConnector(limit=num_connections, ttl_dns_cache=300)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))


async def sleep_until(deadline: float) -> None:
    """Sleep until perf_counter() >= deadline, to ~tens of µs when the loop is idle."""
    while True:
        delay = deadline - time.perf_counter()
        if delay <= 0:
            return
        await asyncio.sleep(delay - SPIN_S if delay > 2 * SPIN_S else 0)


class SlotGate:
    """At most `limit` holders at once (None: unlimited), waiters served in arrival order. A released slot
    is handed straight to the first waiter, so the holders never exceed the limit, not even briefly.
    Each free slot remembers when it fell free: a request that finds one free was ready since then (or
    since it was due), which is how a late dispatcher shows up as send lag rather than client queueing."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self._free_since: collections.deque[float] = collections.deque([-math.inf] * (limit or 0))
        self._waiters: collections.deque[asyncio.Future[float]] = collections.deque()

    @property
    def in_flight(self) -> int:
        return 0 if self.limit is None else self.limit - len(self._free_since)

    async def acquire(self) -> float:
        """Take a slot; returns the perf_counter() at which it fell free (-inf: free from the start)."""
        if self.limit is None:
            return -math.inf
        if self._free_since and not self._waiters:
            return self._free_since.popleft()  # the slot free the longest: the request was ready since then
        waiter: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # a slot was handed over just as we were cancelled: pass it on
            raise

    def release(self) -> None:
        if self.limit is None:
            return
        now = time.perf_counter()
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(now)  # the slot changes hands without ever being free
                return
        self._free_since.append(now)


MIN_DONE_FOR_RATE = 5
"""Requests that must have ended before their rate predicts the rest: the first few end at the pace of a
cold start or a long first prefill (one end gave an ETA of hours on a run that took minutes)."""


def eta_s(total: int, done: int, elapsed_s: float, last_due_s: float,
          first_done_s: float | None = None) -> tuple[float | None, bool]:
    """(seconds until every request has ended, whether that is an estimate rather than a lower bound). The
    estimate is the later of the schedule's end (an open loop cannot finish before its last request is
    due) and the remaining requests at the completion rate since the first one ended (a server slower
    than the offered rate, a closed loop, session turns). Before MIN_DONE_FOR_RATE requests have ended
    only the schedule is known: a lower bound (None once the schedule is over)."""
    schedule = max(last_due_s - elapsed_s, 0.0)
    if done < MIN_DONE_FOR_RATE or first_done_s is None or elapsed_s <= first_done_s:
        return schedule or None, False
    rate = (done - 1) / (elapsed_s - first_done_s)
    return max(schedule, (total - done) / rate), True


def fmt_eta(seconds: float | None, estimate: bool = True) -> str:
    if seconds is None:
        return "ETA ?"
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"ETA {'' if estimate else '>'}{minutes}:{secs:02d}"


class Progress:
    """One-line progress on stderr (sent/completed/cancelled/failed, elapsed, ETA), redrawn at most twice a
    second. `last_due_s`: when the schedule's last dispatch unit is due, for the ETA."""

    def __init__(self, total: int, enabled: bool, last_due_s: float = 0.0) -> None:
        self.total, self.enabled, self.sent, self.last_due_s = total, enabled, 0, last_due_s
        self.first_done_s: float | None = None
        self.records: list[RequestRecord] = []
        self._t_start = time.perf_counter()

    def draw(self, final: bool = False) -> None:
        done = [r.status for r in self.records if r.end_s is not None]
        outcomes = [done.count(s) for s in (RequestStatus.COMPLETED, RequestStatus.CANCELLED, RequestStatus.FAILED)]
        self.draw_counts(self.sent, outcomes, final)

    def draw_counts(self, sent: int, outcomes: Sequence[int], final: bool, label: str = "") -> None:
        """Draw the line from counts: outcomes = (completed, cancelled, failed)."""
        if not self.enabled:
            return
        completed, cancelled, failed = outcomes
        elapsed, done = time.perf_counter() - self._t_start, completed + cancelled + failed
        if self.first_done_s is None and done > 0:
            self.first_done_s = elapsed  # to the redraw period (0.5 s): fine for an ETA
        eta = "done" if final else fmt_eta(*eta_s(self.total, done, elapsed, self.last_due_s, self.first_done_s))
        line = (f"\r[bench{' ' + label if label else ''}] sent {sent}/{self.total}  completed {completed}  "
                f"cancelled {cancelled}  failed {failed}  {elapsed:6.1f} s  {eta}   ")
        sys.stderr.write(line + ("\n" if final else ""))
        sys.stderr.flush()

    async def run(self) -> None:
        while True:
            self.draw()
            await asyncio.sleep(0.5)


class _Dispatcher:
    """Runs one LoadPlan on the current event loop."""

    def __init__(self, ctx: SendContext, plan: LoadPlan, progress: Progress) -> None:
        self.ctx, self.plan, self.progress = ctx, plan, progress
        self.gate = SlotGate(plan.max_concurrency)

    def _record(self, req: TraceRequest, scheduled_s: float, freed_at: float) -> RequestRecord:
        ready_s = max(scheduled_s, freed_at - self.ctx.t0)
        rec = RequestRecord(request_id=req.request_id, request_class=req.request_class, scheduled_s=scheduled_s,
                            client_queue_s=ready_s - scheduled_s, session_id=req.session_id, turn=req.turn,
                            worker=self.plan.worker)
        self.progress.records.append(rec)
        self.progress.sent += 1
        return rec

    async def _send(self, prepared: PreparedRequest, scheduled_s: float, freed_at: float) -> None:
        try:
            await send_request(self.ctx, prepared, self._record(prepared.req, scheduled_s, freed_at))
        finally:
            self.gate.release()

    async def _session(self, turns: Sequence[TraceRequest], first_due_s: float) -> None:
        history, due_s = History(self.ctx.cfg.endpoint), first_due_s
        for turn in turns:
            if turn.turn:
                due_s += turn.think_time_s or 0.0
                await sleep_until(self.ctx.t0 + due_s)
            freed_at = await self.gate.acquire()
            answer: list[str] = []
            try:
                sent = history.request_for(turn)
                rec = await send_request(self.ctx, prepare(self.ctx.cfg, sent), self._record(turn, due_s, freed_at),
                                         answer)
            finally:
                self.gate.release()
            history.add(turn, rec, "".join(answer))
            due_s = rec.end_s or due_s

    async def run(self) -> None:
        standalone = {u[0].request_id: prepare(self.ctx.cfg, u[0]) for u in self.plan.units if u[0].turn is None}
        tasks: list[asyncio.Task[None]] = []
        try:
            for unit, offset in zip(self.plan.units, self.plan.offsets_s):
                await sleep_until(self.ctx.t0 + offset)
                if unit[0].turn is None:
                    freed_at = await self.gate.acquire()
                    tasks.append(asyncio.create_task(self._send(standalone[unit[0].request_id], offset, freed_at)))
                else:
                    tasks.append(asyncio.create_task(self._session(unit, offset)))
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()


async def run_load(session: aiohttp.ClientSession, cfg: ClientConfig, plan: LoadPlan, t0: float | None = None,
                   progress: Progress | None = None) -> LoadResult:
    """Run the plan from t0 (default: now); return when every request has ended."""
    progress = progress or Progress(plan.num_requests, enabled=False)
    ticker = asyncio.create_task(progress.run())
    ctx = SendContext(session=session, cfg=cfg, t0=time.perf_counter() if t0 is None else t0)
    try:
        await _Dispatcher(ctx, plan, progress).run()
    finally:
        ticker.cancel()
    progress.draw(final=True)
    return LoadResult(records=progress.records, t0=ctx.t0)
