"""Admission and graceful shutdown: who may start a generation, and waiting for the ones in flight.

On SIGTERM the server keeps listening but stops admitting: new generation requests get 503 and
`/health` turns 503 (so a load balancer drains it), while requests already admitted run to their end.
`wait_drained` returns once none is in flight or the grace period is over; then the HTTP server
stops, cancelling whatever is left (their cleanup aborts them in the engine).
"""

from __future__ import annotations

import asyncio
import time

from conveyor.server.errors import APIError, ErrorType, RejectReason


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
