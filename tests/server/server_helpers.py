"""Builders for server tests: an in-process app over the fake engine, and SSE parsing."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass

import httpx2 as httpx
import uvicorn
from fake_engine import FakeEngine, FakeEngineConfig
from fastapi import FastAPI

from conveyor.engine.generation_defaults import NO_SAMPLING_DEFAULTS, SamplingDefaults
from conveyor.server.server_config import ServerConfig
from conveyor.server.app import build_app


@asynccontextmanager
async def app_client(engine: FakeEngine | None = None, sampling_defaults: SamplingDefaults = NO_SAMPLING_DEFAULTS,
                     **server: object) -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client talking to `build_app(engine)` in process (ASGI, no sockets). ASGI without lifespan
    never shuts the engine down, so its grammar compile workers are stopped here: left running, they are
    children of the test process that later tests (tensor parallelism) count as leaked."""
    engine = engine or FakeEngine()
    app = build_app(engine, ServerConfig(**server), sampling_defaults=sampling_defaults)  # type: ignore[arg-type]
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver", timeout=10) as client:
            client.app = app  # type: ignore[attr-defined]
            yield client
    finally:
        engine.grammars.shutdown()


def run(coro) -> object:  # noqa: ANN001
    return asyncio.run(coro)


def sse_events(text: str) -> list[object]:
    """The JSON payloads (and the literal "[DONE]") of an SSE body."""
    events: list[object] = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class LiveServer:
    """A uvicorn serving an app on a real socket, in a background thread."""

    url: str
    app: FastAPI
    engine: FakeEngine
    server: uvicorn.Server


@contextmanager
def live_server(config: FakeEngineConfig = FakeEngineConfig(), **server: object) -> Iterator[LiveServer]:
    engine = FakeEngine(config)
    app = build_app(engine, ServerConfig(**server))  # type: ignore[arg-type]
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not uv.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", app, engine, uv)
    finally:
        uv.should_exit = True
        thread.join(timeout=10)
