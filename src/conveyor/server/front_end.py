"""One HTTP front end: serve the OpenAI app over an engine client until drained or the engine dies.

`conveyor serve` runs one in its own process (`server.cli`); `--api-server-count N` runs N, one per
spawned process on a shared socket (`server.api_servers`). Both import this module, so neither
imports the other for it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass

import uvicorn

from conveyor.engine.generation_defaults import (
    NO_SAMPLING_DEFAULTS,
    SamplingDefaults,
    log_sampling_defaults,
)
from conveyor.engine.types import EngineClient, EngineInfo
from conveyor.server.app import build_app
from conveyor.server.http_guard import ConnectionLimits, guarded_protocol
from conveyor.server.lifecycle import DrainingServer
from conveyor.server.server_config import ServerConfig

logger = logging.getLogger("conveyor.serve")
UVICORN_SHUTDOWN_TIMEOUT_S = 2.0
"""After the drain, how long uvicorn waits for connections before cancelling what is left."""


@dataclass(frozen=True)
class ServeOptions:
    """How one front end serves, beyond ServerConfig."""

    sockets: list[socket.socket] | None = None
    """An already bound listening socket (shared by the front ends of --api-server-count)."""
    drain_signals: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)
    """Signals that start a drain."""
    metrics_dir: str | None = None
    """prometheus_client's multiprocess directory, when several front ends share /metrics."""
    announce: bool = True
    """Log the URL once bound (the launcher of several front ends announces instead)."""
    on_started: Callable[[], None] | None = None
    """Called once uvicorn listens."""
    sampling_defaults: SamplingDefaults = NO_SAMPLING_DEFAULTS
    """The model's default sampling parameters (--generation-config), read once by the launching process."""


def log_startup(info: EngineInfo, sampling_defaults: SamplingDefaults = NO_SAMPLING_DEFAULTS) -> None:
    """The resolved flags, the KV capacity and the model's sampling defaults, logged once by the process
    that started the engine."""
    config = " ".join(f"--{key}={value}" for key, value in sorted(info.config.items()))
    logger.info("resolved config: %s", config)
    logger.info("KV cache: %d blocks x %d tokens = %d tokens; max concurrency at max_model_len=%d: %.2f requests",
                info.num_kv_blocks, info.block_size, info.num_kv_tokens, info.max_model_len, info.max_concurrency)
    log_sampling_defaults(sampling_defaults)


async def serve(engine: EngineClient, server_config: ServerConfig, options: ServeOptions = ServeOptions()) -> int:
    """Serve until a signal (drain, then stop) or the engine's death; then let go of the engine.
    Returns the exit status: 0 after a drain, 1 when the engine died."""
    app = build_app(engine, server_config, options.metrics_dir, options.sampling_defaults)
    config = uvicorn_config(app, server_config)
    server = DrainingServer(config, app.state.ctx.gate, server_config.shutdown_grace_s, engine.abort,
                            options.drain_signals)
    engine.add_dead_listener(server.on_engine_dead)
    announce = asyncio.ensure_future(_when_started(server, engine.info.model_name, options))
    try:
        await server.serve(options.sockets)
    finally:
        announce.cancel()
        await engine.shutdown()
    if server.engine_died:
        logger.error("the engine core died; the server stopped")
        return 1
    logger.info("server stopped")
    return 0


def uvicorn_config(app: object, server_config: ServerConfig) -> uvicorn.Config:
    """uvicorn with conveyor's connection guard (header timeout, connection cap) and vLLM's HTTP flags."""
    options = server_config.uvicorn
    limits = ConnectionLimits(server_config.header_timeout_s, server_config.limit_concurrency)
    return uvicorn.Config(
        app, host=server_config.host, port=server_config.port, uds=options.uds, log_level=options.log_level,
        access_log=options.access_log, lifespan="off", timeout_graceful_shutdown=UVICORN_SHUTDOWN_TIMEOUT_S,
        http=guarded_protocol(limits), limit_concurrency=server_config.limit_concurrency,
        timeout_keep_alive=server_config.timeout_keep_alive_s, root_path=options.root_path,
        ssl_keyfile=options.ssl_keyfile, ssl_certfile=options.ssl_certfile, ssl_ca_certs=options.ssl_ca_certs,
        ssl_cert_reqs=options.ssl_cert_reqs, ssl_ciphers=options.ssl_ciphers or "TLSv1",
        h11_max_incomplete_event_size=options.h11_max_incomplete_event_size,
    )


async def _when_started(server: uvicorn.Server, model_name: str, options: ServeOptions) -> None:
    """Log the URL once bound (the real port, when --port 0 picked one)."""
    while not server.started:
        await asyncio.sleep(0.05)
    if options.on_started is not None:
        options.on_started()
    if options.announce:
        address = server.servers[0].sockets[0].getsockname()
        where = f"unix:{address}" if isinstance(address, str) else f"http://{address[0]}:{address[1]}"
        logger.info("serving %s at %s/v1 (health: /health, metrics: /metrics)", model_name, where)
