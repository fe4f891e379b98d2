"""Exact prompt lengths from a server's `/tokenize` endpoint (vLLM's and conveyor's shape).

The benchmark needs no tokenizer: synthetic words are ≈ 1 token each (docs/trace-format.md). When the
exact count matters (importing real text, or a model whose tokenizer splits the word list), the server
that will be benchmarked can count: POST /tokenize {model, prompt | messages} -> {"count": n, ...}.
Requests go 16 at a time; any failure is an error naming the request, never a silent approximation.
"""

from __future__ import annotations

import asyncio
import dataclasses

import aiohttp

from conveyor.bench.trace.traces import TraceRequest

MAX_IN_FLIGHT = 16


class TokenizeError(ValueError):
    """The server could not count a prompt; the message names the request and the URL."""


async def _count(session: aiohttp.ClientSession, url: str, model: str | None, req: TraceRequest) -> int:
    body: dict[str, object] = {"model": model} if model else {}
    if req.messages is not None:
        body["messages"] = req.messages
    elif req.prompt is not None:
        body["prompt"] = req.prompt
    else:
        return len(req.prompt_token_ids or [])
    async with session.post(url, json=body) as resp:
        data = await resp.json(content_type=None) if resp.status == 200 else None
    count = data["count"] if isinstance(data, dict) and "count" in data else None  # /tokenize's answer, read once
    if not isinstance(count, int):
        raise TokenizeError(f"--tokenize-url {url}: no token count for request {req.request_id} (HTTP {resp.status})")
    return int(count)


async def _count_all(url: str, model: str | None, requests: list[TraceRequest]) -> list[int]:
    gate = asyncio.Semaphore(MAX_IN_FLIGHT)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        async def one(req: TraceRequest) -> int:
            async with gate:
                return await _count(session, url, model, req)
        try:
            return list(await asyncio.gather(*(one(r) for r in requests)))
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise TokenizeError(f"--tokenize-url {url}: {exc!r}") from exc


def with_exact_lengths(requests: list[TraceRequest], base_url: str, model: str | None = None) -> list[TraceRequest]:
    """Requests whose prompt_len is the server's token count (shared_prefix_len stays in words)."""
    url = base_url.rstrip("/") + "/tokenize"
    counts = asyncio.run(_count_all(url, model, requests))
    return [dataclasses.replace(r, prompt_len=n) for r, n in zip(requests, counts)]
