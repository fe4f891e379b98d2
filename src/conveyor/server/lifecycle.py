"""Admission to the HTTP side and graceful shutdown: who may start a generation, and ending the ones in flight.

On SIGTERM the server keeps listening but stops admitting: new generation requests get 503 and
`/health` turns 503 (so a load balancer drains it), while requests already admitted run to their end.
If `--shutdown-grace` runs out first, every request still in flight is aborted in the engine: its
stream ends properly, with a last chunk carrying `finish_reason: "abort"` and `data: [DONE]`, not a
cut connection. Then the HTTP server stops. If the engine core dies, the server stops at once and
`serve` reports it (the process exits non-zero).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Generator
from types import FrameType

import uvicorn

from conveyor.server.errors import APIError, ErrorType, RejectReason

logger = logging.getLogger(__name__)


class AdmissionGate:
    """Counts in-flight generations; closed once draining starts. Event-loop thread only."""

    def __init__(self) -> None:
        self.draining = False
        self.engine_dead = False
        """Set when the engine reported EngineDeadError: health turns 503 for good."""
        self._in_flight: dict[str, int] = {}  # request id -> slots held (an id is normally held once)
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def num_in_flight(self) -> int:
        return sum(self._in_flight.values())

    def in_flight_request_ids(self) -> list[str]:
        return list(self._in_flight)

    def check_open(self) -> None:
        """Raise the 503 a new request gets while draining."""
        if self.draining:
            raise APIError(503, "the server is shutting down and accepts no new requests",
                           ErrorType.OVERLOADED, reason=RejectReason.SHUTTING_DOWN,
                           headers={"Connection": "close"})

    def admit(self, request_id: str) -> InFlightSlot:
        """Take one in-flight slot for a generation; release it when the response has ended."""
        self.check_open()
        self._in_flight[request_id] = self._in_flight.get(request_id, 0) + 1
        self._idle.clear()
        return InFlightSlot(self, request_id)

    def _release(self, request_id: str) -> None:
        left = self._in_flight.pop(request_id, 1) - 1
        if left > 0:
            self._in_flight[request_id] = left
        if not self._in_flight:
            self._idle.set()

    def start_draining(self) -> None:
        self.draining = True

    def mark_engine_dead(self) -> None:
        self.engine_dead = True

    async def wait_drained(self, grace_s: float) -> bool:
        """Wait until nothing is in flight or `grace_s` passed; True if everything finished."""
        deadline = time.monotonic() + grace_s
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            return False
        return True


class InFlightSlot:
    """One admitted generation; `release` is idempotent (streams end in several ways)."""

    def __init__(self, gate: AdmissionGate, request_id: str) -> None:
        self._gate: AdmissionGate | None = gate
        self._request_id = request_id

    def release(self) -> None:
        if self._gate is not None:
            self._gate._release(self._request_id)
            self._gate = None


ABORT_SETTLE_S = 2.0
"""After aborting at the end of the grace period, how long the streams get to send their last chunk."""


class DrainingServer(uvicorn.Server):
    """uvicorn, with SIGTERM/SIGINT meaning "drain, then stop" instead of "stop now".

    The first signal closes the gate and waits (up to `grace_s`) for in-flight requests while still
    listening, so late clients get a clean 503 rather than a refused connection; requests still in
    flight then are aborted through `abort` and get `ABORT_SETTLE_S` to end their streams; then
    uvicorn shuts down as usual. A second signal stops at once. The signal is not re-raised afterwards
    (uvicorn's default), so the process exits 0 after a graceful drain. `drain_signals` names the
    signals that start a drain (a front end spawned by `--api-server-count` drains on SIGUSR1 from
    its launcher and ignores the terminal's SIGINT/SIGTERM).
    """

    def __init__(self, config: uvicorn.Config, gate: AdmissionGate, grace_s: float,
                 abort: Callable[[str], Awaitable[None]],
                 drain_signals: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)) -> None:
        super().__init__(config)
        self._gate = gate
        self._grace_s = grace_s
        self._abort = abort
        self._drain_signals = drain_signals
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self.engine_died = False

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in self._drain_signals}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._gate.draining or self._loop is None:
            self.should_exit = True  # second signal (or not serving yet): stop now
            self.force_exit = self._gate.draining
            return
        self._gate.start_draining()
        self._loop.call_soon_threadsafe(self._start_drain, signal.Signals(sig).name)

    def on_engine_dead(self) -> None:
        """The engine core died: stop serving now (the streams have been failed already)."""
        self.engine_died = True
        self._gate.engine_dead = True
        self.should_exit = True

    def _start_drain(self, signal_name: str) -> None:
        self._drain_task = asyncio.ensure_future(self._drain(signal_name))

    async def _drain(self, signal_name: str) -> None:
        logger.info("%s: no longer admitting; waiting up to %.1f s for %d in-flight request(s)",
                    signal_name, self._grace_s, self._gate.num_in_flight)
        if await self._gate.wait_drained(self._grace_s):
            logger.info("all in-flight requests finished; shutting down")
        else:
            request_ids = self._gate.in_flight_request_ids()
            logger.warning("grace period over with %d request(s) in flight; aborting them", len(request_ids))
            for request_id in request_ids:
                await self._abort(request_id)
            await self._gate.wait_drained(ABORT_SETTLE_S)
        self.should_exit = True
