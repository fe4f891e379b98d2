"""Admission and graceful shutdown: who may start a generation, and waiting for the ones in flight.

On SIGTERM the server keeps listening but stops admitting: new generation requests get 503 and
`/health` turns 503 (so a load balancer drains it), while requests already admitted run to their end.
`wait_drained` returns once none is in flight or the grace period is over; then the HTTP server
stops, cancelling whatever is left (their cleanup aborts them in the engine).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
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
        self._num_in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    def check_open(self) -> None:
        """Raise the 503 a new request gets while draining."""
        if self.draining:
            raise APIError(503, "the server is shutting down and accepts no new requests",
                           ErrorType.OVERLOADED, reason=RejectReason.SHUTTING_DOWN,
                           headers={"Connection": "close"})

    def admit(self) -> InFlightSlot:
        """Take one in-flight slot for a generation; release it when the response has ended."""
        self.check_open()
        self._num_in_flight += 1
        self._idle.clear()
        return InFlightSlot(self)

    def _release(self) -> None:
        self._num_in_flight -= 1
        if self._num_in_flight == 0:
            self._idle.set()

    def start_draining(self) -> None:
        self.draining = True

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

    def __init__(self, gate: AdmissionGate) -> None:
        self._gate: AdmissionGate | None = gate

    def release(self) -> None:
        if self._gate is not None:
            self._gate._release()
            self._gate = None


class DrainingServer(uvicorn.Server):
    """uvicorn, with SIGTERM/SIGINT meaning "drain, then stop" instead of "stop now".

    The first signal closes the gate and waits (up to `grace_s`) for in-flight requests while still
    listening, so late clients get a clean 503 rather than a refused connection; then uvicorn shuts
    down as usual. A second signal stops at once. The signal is not re-raised afterwards (uvicorn's
    default), so the process exits 0 after a graceful drain.
    """

    def __init__(self, config: uvicorn.Config, gate: AdmissionGate, grace_s: float) -> None:
        super().__init__(config)
        self._gate = gate
        self._grace_s = grace_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._gate.draining or self._loop is None:
            self.should_exit = True  # second signal (or not serving yet): stop now
            self.force_exit = self._gate.draining
            return
        self._gate.start_draining()
        self._loop.call_soon_threadsafe(self._start_drain, signal.Signals(sig).name)

    def _start_drain(self, signal_name: str) -> None:
        self._drain_task = asyncio.ensure_future(self._drain(signal_name))

    async def _drain(self, signal_name: str) -> None:
        logger.info("%s: no longer admitting; waiting up to %.1f s for %d in-flight request(s)",
                    signal_name, self._grace_s, self._gate.num_in_flight)
        if await self._gate.wait_drained(self._grace_s):
            logger.info("all in-flight requests finished; shutting down")
        else:
            logger.warning("grace period over with %d request(s) in flight; aborting them",
                           self._gate.num_in_flight)
        self.should_exit = True
