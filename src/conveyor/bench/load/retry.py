"""Opt-in client retries of HTTP 503, honouring Retry-After, as a well-behaved production client does.

The model: a server that bounds its queue answers 503 with `Retry-After`; a real client waits and tries
again, so the cost per accepted response must count the responses accepted *after* a retry (and the
latency they paid). With `--retry-503 N` every request that gets a 503 before its stream starts is
retried up to N times, waiting Retry-After seconds (capped by `max_wait_s`; `default_wait_s` when the
header is missing or unreadable). The retry is an aiohttp client middleware, so the request's clock
(TTFT, E2E) keeps running from the first attempt: the wait is part of what the user sees. Attempts are
counted per request id (the `x-request-id` header) and land in summary.json `retries`. Off by default:
a benchmark normally reports the server's first answer. A 503 sent inside an HTTP 200 stream (vLLM's
streaming rejections) is not retried: the stream has started.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import hdrs

from conveyor.bench.load.client import REQUEST_ID_HEADER

Handler = Callable[[aiohttp.ClientRequest], Awaitable[aiohttp.ClientResponse]]


@dataclass(frozen=True)
class RetryPolicy:
    """How 503s are retried (max_retries 0: never)."""

    max_retries: int = 0
    """Retries per request after a 503 (0: off)."""
    max_wait_s: float = 30.0
    """Longest wait honoured from one Retry-After."""
    default_wait_s: float = 1.0
    """Wait when the 503 carries no usable Retry-After."""

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError(f"--retry-503 must be >= 0, got {self.max_retries}")
        if self.max_wait_s <= 0 or self.default_wait_s < 0:
            raise ValueError("--retry-max-wait-s must be > 0")

    @property
    def enabled(self) -> bool:
        return self.max_retries > 0


def retry_after_s(header: str | None, policy: RetryPolicy) -> float:
    """Seconds from a Retry-After header given in seconds (HTTP dates are not used by LLM servers)."""
    try:
        value = float(header) if header is not None else policy.default_wait_s
    except ValueError:
        value = policy.default_wait_s
    return min(max(0.0, value), policy.max_wait_s)


@dataclass
class RetryLog:
    """Attempts seen by the middleware over one run."""

    retries_by_request: dict[str, int] = field(default_factory=dict)
    """Request id -> retries it took (only requests that were retried)."""
    wait_s: float = 0.0
    """Total time spent waiting on Retry-After."""

    @property
    def num_retried_requests(self) -> int:
        return len(self.retries_by_request)

    @property
    def num_retries(self) -> int:
        return sum(self.retries_by_request.values())

    def summary(self, policy: RetryPolicy) -> dict[str, float]:
        """summary.json `retries` (measure/ builds its typed RetrySummary from the properties instead)."""
        return {"max_retries": policy.max_retries, "num_retried_requests": self.num_retried_requests,
                "num_retries": self.num_retries, "retry_wait_s": self.wait_s}


def retry_middleware(policy: RetryPolicy, log: RetryLog) -> Callable[[aiohttp.ClientRequest, Handler],
                                                                      Awaitable[aiohttp.ClientResponse]]:
    """An aiohttp client middleware retrying 503 responses per `policy`, recording into `log`."""

    async def middleware(request: aiohttp.ClientRequest, handler: Handler) -> aiohttp.ClientResponse:
        response = await handler(request)
        request_id = request.headers.get(REQUEST_ID_HEADER, str(request.url))
        attempt = 0
        while response.status == 503 and attempt < policy.max_retries:
            wait = retry_after_s(response.headers.get(hdrs.RETRY_AFTER), policy)
            response.release()
            await asyncio.sleep(wait)
            attempt += 1
            log.retries_by_request[request_id] = attempt
            log.wait_s += wait
            response = await handler(request)
        return response

    return middleware


def new_retrying_session(policy: RetryPolicy, log: RetryLog) -> aiohttp.ClientSession:
    """As loadgen.new_session (unlimited connections, per-request timeouts), with the retry middleware."""
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None),
                                 middlewares=(retry_middleware(policy, log),))


def add_retry_arguments(parser: argparse.ArgumentParser | Any) -> None:
    """--retry-503 N and --retry-max-wait-s (a parser or an argument group)."""
    parser.add_argument("--retry-503", dest="retry_503", type=int, default=None, metavar="N",
                        help="retry a request answered 503 up to N times, honouring Retry-After (default 0: off)")
    parser.add_argument("--retry-max-wait-s", dest="retry_max_wait_s", type=float, default=None,
                        help="longest Retry-After honoured, seconds (default 30)")


def policy_from_args(args: argparse.Namespace) -> RetryPolicy | None:
    """The policy the flags ask for (None: retries off)."""
    retries = getattr(args, "retry_503", None)
    if not retries:
        return None
    wait = getattr(args, "retry_max_wait_s", None)
    return RetryPolicy(max_retries=retries, **({} if wait is None else {"max_wait_s": wait}))
