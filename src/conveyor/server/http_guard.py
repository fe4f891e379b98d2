"""Connection-level limits uvicorn's h11 protocol does not have: a header-read timeout and a hard cap on
open connections.

uvicorn closes a keep-alive connection only after a response (`timeout_keep_alive`); a socket that
connects and sends nothing, or sends half a request head and stalls (slowloris), is kept forever, and
`limit_concurrency` only answers 503 once a request arrives. `GuardedH11Protocol` arms a timer when
the connection opens and after each response; if no complete request head has arrived when it fires,
the connection is closed. A connection beyond `limit_concurrency` is answered 503 and closed at once.
Passed to uvicorn as `Config(http=...)`; the limits come from a `ConnectionLimits` set on the class by
`guarded_protocol` (uvicorn builds protocol instances itself, with its own arguments).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

_REFUSED_BODY = (b'{"error": {"message": "too many open connections; retry later", '
                 b'"type": "service_unavailable_error", "param": null, "code": 503}}')
_REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"retry-after: 1\r\ncontent-length: %d\r\n\r\n%s" % (len(_REFUSED_BODY), _REFUSED_BODY))


@dataclass(frozen=True)
class ConnectionLimits:
    """What a guarded connection may do."""

    header_timeout_s: float
    """Seconds to send a complete request head (from connect, and from the end of each response)."""
    max_connections: int | None
    """Most open connections; None: no cap."""


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header-read timeout and a connection cap (see the module docstring)."""

    limits = ConnectionLimits(header_timeout_s=10.0, max_connections=None)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        cap = self.limits.max_connections
        if cap is not None and len(self.connections) > cap:
            logger.warning("refused a connection: %d open, --limit-concurrency %d", len(self.connections) - 1, cap)
            transport.write(_REFUSED)
            transport.close()
            return
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # a whole request head has arrived
            self._cancel_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._on_header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """A protocol class carrying `limits` (one class per server: tests run several in one process)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})
