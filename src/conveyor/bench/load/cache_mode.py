"""Which prefix-cache state a run measures: isolated (the default) or warm on purpose.

A server's prefix cache outlives a run. Replaying a trace on a server that just served it hits the
blocks the previous run left, so without care the second run of one configuration is several times
faster than the first, and a sweep's later points inherit its earlier ones' cache (issue 33). vLLM gives
clients the tool: a request's `cache_salt` enters the hash of its first block, so requests with
different salts never share a cached block, and requests with one salt share as usual.

- isolated: every request of a run carries one salt made for that run (its label and a random part):
  the trace's own sharing (a session's history, an agent group's system prompt) stays intact within
  the run, and nothing an earlier run cached can be hit. Before the first request one tiny probe (its
  own salt, one output token, sent before the "before" /metrics scrape so no counter includes it) asks
  whether the server accepts the field: a 4xx naming `cache_salt` stops the run at once with a one-line
  error suggesting `--cache-mode warm`, instead of a run of failed requests.
- warm: no salt, and a warm-up pass first replays every prompt of the trace once (as a standalone
  request, one output token, a few at a time, also before the "before" scrape), so the run measures a
  server whose cache already holds the trace: a steady state asked for on purpose, not inherited.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import re
import uuid
from collections.abc import Sequence

import aiohttp

from conveyor.bench.load.client import ClientConfig, Endpoint, json_dumps
from conveyor.bench.load.loadgen import LoadPlan, run_load
from conveyor.bench.trace.traces import TraceRequest

WARM_PASS_CONCURRENCY = 4
"""Requests in flight during the warm-up pass: enough to be quick, few enough not to queue or preempt
on a small server (the pass fills the cache; how fast does not matter)."""
PROBE_TIMEOUT_S = 60.0
"""The probe gives up after this long (a server that slow fails the run's own requests anyway)."""


class CacheMode(str, enum.Enum):
    ISOLATED = "isolated"
    WARM = "warm"


class CacheSaltRefused(ValueError):
    """The server rejects the `cache_salt` field; the message is the one line to show."""


def new_salt(label: str) -> str:
    """One run's salt: readable (the label) and never reused (a random part). Only [A-Za-z0-9._-] and at
    most 64 characters: run labels hold '@', '#' and '/', which some servers refuse in a salt."""
    readable = re.sub(r"[^A-Za-z0-9._-]", "-", label or "run")[:40]
    return f"conveyor-{readable}-{uuid.uuid4().hex[:12]}"


def _probe_body(cfg: ClientConfig, salt: str) -> bytes:
    body: dict[str, object] = {"model": cfg.model, "cache_salt": salt}
    if cfg.endpoint is Endpoint.CHAT:
        body.update(messages=[{"role": "user", "content": "ping"}], max_completion_tokens=1)
    else:
        body.update(prompt="ping", max_tokens=1)
    return json_dumps(body)


async def probe_salt(session: aiohttp.ClientSession, cfg: ClientConfig) -> None:
    """Raise CacheSaltRefused if the server answers a salted request with a 4xx naming cache_salt; any
    other outcome (success, 5xx, a timeout) lets the run go on, where failures are measured as data."""
    assert cfg.cache_salt is not None
    headers = {"Content-Type": "application/json"}
    if cfg.api_key:
        headers["Authorization"] = f"Bearer {cfg.api_key}"
    url = cfg.base_url.rstrip("/") + cfg.endpoint.path
    try:
        async with session.post(url, data=_probe_body(cfg, cfg.cache_salt + "-probe"), headers=headers,
                                timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)) as resp:
            text = (await resp.text(errors="replace"))[:300]
            status = resp.status
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return
    if 400 <= status < 500 and "cache_salt" in text:
        raise CacheSaltRefused(f"the server refuses the cache_salt field (HTTP {status}: {' '.join(text.split())}); "
                               "rerun with --cache-mode warm to benchmark without prefix-cache isolation")


def _warm_request(req: TraceRequest) -> TraceRequest:
    """The request as the warm-up pass sends it: its own prompt, standalone, one output token, never cancelled."""
    return dataclasses.replace(req, output_len=1, session_id=None, turn=None, think_time_s=None,
                               cancel_after_s=None, cancel_after_tokens=None, arrival_s=None)


async def warm_pass(session: aiohttp.ClientSession, cfg: ClientConfig, requests: Sequence[TraceRequest]) -> int:
    """Replay every prompt once, WARM_PASS_CONCURRENCY at a time; returns how many were sent. A session's
    later turns go with their own input only (their history holds answers this pass does not produce)."""
    units = [[_warm_request(r)] for r in requests]
    plan = LoadPlan(units=units, offsets_s=[0.0] * len(units), max_concurrency=WARM_PASS_CONCURRENCY)
    result = await run_load(session, dataclasses.replace(cfg, cache_salt=None), plan)
    return len(result.records)
