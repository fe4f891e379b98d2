"""Several load-generator processes for one run (`--workers N`), merged into one set of records.

One process's event loop tops out at roughly 1,000 / (client CPU ms per request) req/s; past that its
send lag grows and the run is invalid. The schedule is drawn once, in the parent, and dispatch unit i
goes to worker i mod N with its due time unchanged, so the union of the workers' schedules is exactly
the one drawn (each worker offers ~R/N with the run's own time base; a session stays in one worker).
A concurrency cap is split as evenly as it goes (its parts sum to the cap, so the cap holds globally; a
slot free in one worker does not serve a request waiting in another, the price of no cross-process
locking). Every worker waits until all are started, then starts at one wall-clock instant the parent
picks, converted to its own perf_counter, so record times share one origin. Records come back whole
(every TTFT, every ITL gap) and the summary is computed over all of them: percentiles of the merged
samples, never averages of per-worker percentiles. Each worker reports its CPU time and the parent
judges each worker's send lag on its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from conveyor.bench.load.client import ClientConfig, RequestRecord, RequestStatus
from conveyor.bench.load.loadgen import LoadPlan, Progress, new_session, run_load

START_MARGIN_S = 0.2
"""The common start is this far after the last worker reported ready (time to hand out the instant)."""
T = TypeVar("T")


class WorkerError(RuntimeError):
    """A worker process died or sent nothing back."""


@dataclass(frozen=True)
class WorkerStats:
    """What one load-generator process cost."""

    worker: int
    """Its index."""
    num_requests: int
    """Requests it sent."""
    cpu_s: float
    """Its CPU time (user + system) over the run."""


@dataclass(frozen=True)
class _Report:
    stats: WorkerStats
    records: list[dict[str, Any]] = field(default_factory=list)


def split_plan(plan: LoadPlan, num_workers: int) -> list[LoadPlan]:
    """Dispatch unit i -> worker i mod N, due times unchanged; the cap split into parts summing to it."""
    if num_workers < 1:
        raise ValueError(f"--workers must be >= 1, got {num_workers}")
    cap = plan.max_concurrency
    if cap is not None and cap < num_workers:
        raise ValueError(f"--max-concurrency {cap} cannot be split over --workers {num_workers}: give each "
                         "worker at least one slot (fewer workers)")
    plans = []
    for w in range(num_workers):
        part = None if cap is None else cap // num_workers + (1 if w < cap % num_workers else 0)
        plans.append(LoadPlan(units=plan.units[w::num_workers], offsets_s=plan.offsets_s[w::num_workers],
                              max_concurrency=part, worker=w))
    return plans


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop event loop when it is installed (`conveyor[fast]`), else the stdlib one."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run` on `new_event_loop()` (asyncio.Runner's loop_factory needs Python 3.11; we support 3.10)."""
    loop = new_event_loop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(coro)
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


class _SharedProgress(Progress):
    """A worker's progress, published into its 4 slots of the shared counter array instead of drawn."""

    def __init__(self, total: int, counts: Any, worker: int) -> None:
        super().__init__(total, enabled=False)
        self.shared, self.base = counts, 4 * worker

    def draw(self, final: bool = False) -> None:
        done = [r.status for r in self.records if r.end_s is not None]
        values = (self.sent, done.count(RequestStatus.COMPLETED), done.count(RequestStatus.CANCELLED),
                  done.count(RequestStatus.FAILED))
        for i, value in enumerate(values):
            self.shared[self.base + i] = value


def _worker_main(conn: Connection, cfg: ClientConfig, plan: LoadPlan, counts: Any) -> None:
    """Entry point of a spawned worker: report ready, receive the start instant, run, send records back."""
    conn.send("ready")
    start_wall: float = conn.recv()
    cpu0 = time.process_time()
    result = run_async(_run_worker(cfg, plan, start_wall, _SharedProgress(plan.num_requests, counts, plan.worker)))
    stats = WorkerStats(worker=plan.worker, num_requests=len(result), cpu_s=time.process_time() - cpu0)
    conn.send(_Report(stats=stats, records=[r.to_json() for r in result]))
    conn.close()


async def _run_worker(cfg: ClientConfig, plan: LoadPlan, start_wall: float, progress: Progress) -> list[RequestRecord]:
    t0 = time.perf_counter() + (start_wall - time.time())
    async with new_session() as session:
        return (await run_load(session, cfg, plan, t0=t0, progress=progress)).records


class WorkerPool:
    """N spawned worker processes running one split plan; `run()` returns their merged records."""

    def __init__(self, cfg: ClientConfig, plans: list[LoadPlan], show_progress: bool) -> None:
        self.cfg, self.plans = cfg, plans
        self.progress = Progress(sum(p.num_requests for p in plans), enabled=show_progress,
                                 last_due_s=max((max(p.offsets_s, default=0.0) for p in plans), default=0.0))
        self._mp = multiprocessing.get_context("spawn")  # no fork of a process holding an event loop
        self.counts = self._mp.Array("q", 4 * len(plans), lock=False)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(plans))
        self._procs: list[Any] = []
        self._conns: list[Connection] = []

    def start(self) -> None:
        for plan in self.plans:
            parent_end, child_end = self._mp.Pipe()
            proc = self._mp.Process(target=_worker_main, args=(child_end, self.cfg, plan, self.counts), daemon=True)
            proc.start()
            child_end.close()
            self._procs.append(proc)
            self._conns.append(parent_end)

    async def _recv_all(self) -> list[Any]:
        loop = asyncio.get_running_loop()
        return list(await asyncio.gather(*(loop.run_in_executor(self._pool, self._recv, w)
                                           for w in range(len(self._conns)))))

    def _recv(self, worker: int) -> Any:
        try:
            return self._conns[worker].recv()
        except (EOFError, OSError) as exc:
            code = self._procs[worker].exitcode
            raise WorkerError(f"load-generator worker {worker} died (exit code {code}): {exc!r}") from exc

    async def run(self, on_start: Callable[[float], None]) -> tuple[list[RequestRecord], list[WorkerStats]]:
        """Start all workers at one instant (on_start gets it as this process's perf_counter t0)."""
        try:
            await self._recv_all()  # every worker imported and ready
            start_wall = time.time() + START_MARGIN_S
            for conn in self._conns:
                conn.send(start_wall)
            on_start(time.perf_counter() + (start_wall - time.time()))
            ticker = asyncio.create_task(self._draw_progress())
            try:
                reports: list[_Report] = await self._recv_all()
            finally:
                ticker.cancel()
            self._draw(final=True)
        finally:
            self.close()
        records = [RequestRecord.from_json(r) for rep in reports for r in rep.records]
        return records, [rep.stats for rep in reports]

    def _draw(self, final: bool = False) -> None:
        totals = [sum(self.counts[4 * w + i] for w in range(len(self.plans))) for i in range(4)]
        self.progress.draw_counts(totals[0], totals[1:], final, label=f"{len(self.plans)} workers")

    async def _draw_progress(self) -> None:
        while True:
            self._draw()
            await asyncio.sleep(0.5)

    def close(self) -> None:
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
        for conn in self._conns:
            conn.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
