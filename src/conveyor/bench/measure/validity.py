"""Run validity: whether a run measured the server, or the client's own limits.

The model: a run is *invalid* when the load generator could not do what the run claims, so that its
numbers say nothing about the server either way:
- send lag: the p99 of (actual − scheduled send time) exceeds its bound: arrivals were late (judged by
  the load side, load_summary.load_validity, per worker; passed in as a prior reason);
- client CPU saturated: the benchmark process used at least `max_client_cpu` of one core over the run
  (the asyncio client runs on one core; at that point its own timestamps queue behind its work);
- client-side errors: requests that failed on the client's side of the wire: the client could not
  open a connection for a local reason (too many open files, no free port), or the server refused
  the request itself as malformed (HTTP 4xx other than 429: longer than its max_model_len, unknown
  model): the trace or the flags do not fit this server, and re-running will not measure capacity.
An invalid run is never counted as a pass or a failure: the sweep re-runs it (up to a bound), the
report greys it out and keeps it out of plots, and diagnoses skip it. Overload is not a client error:
503s, 429s, timeouts and a server that goes away are the server's answers and count against it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from conveyor.bench.load.client import ErrorKind, RequestRecord, RequestStatus

LOCAL_CONNECTION_ERRORS = ("too many open files", "cannot assign requested address", "errno 24", "errno 23",
                           "errno 99", "address already in use")
"""Connection error texts whose cause is on the client machine."""


@dataclass(frozen=True)
class ValidityBounds:
    """When a run is invalid."""

    max_client_cpu: float = 0.9
    """Benchmark process CPU time / wall time (cores) at or above this: the client saturated its core."""


@dataclass(frozen=True)
class ClientCpu:
    """CPU the benchmark process used over a run."""

    cpu_s: float
    """Process CPU time (user + system), seconds."""
    wall_s: float
    """Wall time, seconds."""

    @property
    def utilization(self) -> float:
        """Cores used on average (1.0 = one core busy all the time)."""
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0


class ClientCpuMeter:
    """Measures this process's CPU time between start() and stop()."""

    def __init__(self) -> None:
        self._cpu0 = time.process_time()
        self._wall0 = time.perf_counter()

    def stop(self) -> ClientCpu:
        return ClientCpu(time.process_time() - self._cpu0, time.perf_counter() - self._wall0)


def is_client_side_error(record: RequestRecord) -> bool:
    """A failure on the client's side of the wire (see the module docstring)."""
    if record.status is not RequestStatus.FAILED:
        return False
    if record.error_kind is ErrorKind.HTTP_4XX and record.http_status not in (429, None):
        return True
    message = (record.error_message or "").lower()
    return record.error_kind is ErrorKind.CONNECTION and any(text in message for text in LOCAL_CONNECTION_ERRORS)


@dataclass(frozen=True)
class Validity:
    """The verdict on the measurement itself."""

    reasons: tuple[str, ...]
    """Why the run is invalid (empty: valid)."""
    client_cpu_utilization: float | None
    """Cores the client used (None: not measured)."""
    num_client_side_errors: int
    """Requests that failed on the client's side."""

    @property
    def valid(self) -> bool:
        return not self.reasons

    @property
    def reason(self) -> str | None:
        return "; ".join(self.reasons) if self.reasons else None


def assess(records: Sequence[RequestRecord], prior: Sequence[str], cpu: ClientCpu | None,
           bounds: ValidityBounds) -> Validity:
    """Every reason this run did not measure the server: `prior` (the load side's: send lag per worker, an
    empty steady-state window), then client CPU and client-side errors."""
    reasons = list(prior)
    utilization = None if cpu is None else cpu.utilization
    if utilization is not None and utilization >= bounds.max_client_cpu:
        reasons.append(f"client CPU saturated: the benchmark used {utilization:.0%} of a core (bound "
                       f"{bounds.max_client_cpu:.0%}, {os.cpu_count()} cores here); run it on a less loaded machine")
    client_errors = [r for r in records if is_client_side_error(r)]
    if client_errors:
        first = client_errors[0]
        reasons.append(f"client-side errors: {len(client_errors)} request(s) failed before the server could "
                       f"serve them (first: {first.error_kind.value if first.error_kind else '?'} "
                       f"{first.http_status or ''} {(first.error_message or '')[:120]!r}); fix the trace or the flags")
    return Validity(tuple(reasons), utilization, len(client_errors))
