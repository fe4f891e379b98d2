"""`conveyor serve [MODEL]`: the OpenAI-compatible server, with vLLM's engine flags, in two kinds of process.

`run` starts the engine-core process (`engine.launcher.EngineProcess`: model, scheduler, KV cache;
the only process that imports torch), waits for its READY handshake (a start-up failure is printed
as one line and the command exits 1), then serves HTTP from this process (`--api-server-count 1`,
the default) or from N spawned front-end processes sharing one listening socket
(`server.api_servers`). SIGTERM drains (see `lifecycle.DrainingServer`), then the engine is told to
stop and the command exits 0; if the engine dies, the server stops at once and exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields

import prometheus_client
import uvicorn

from conveyor.config import ConfigError, EngineConfig, ServerConfig
from conveyor.engine.args import add_engine_arguments, engine_config_from_args, with_overrides
from conveyor.engine.core_client import AsyncEngineClient, ClientConfig
from conveyor.engine.launcher import LOG_FORMAT, EngineProcess, EngineStartupError
from conveyor.engine.types import EngineClient, EngineInfo
from conveyor.server.app import build_app
from conveyor.server.lifecycle import DrainingServer

logger = logging.getLogger("conveyor.serve")
UVICORN_SHUTDOWN_TIMEOUT_S = 2.0
"""After the drain, how long uvicorn waits for connections before cancelling what is left."""
_SERVER_FLAGS = {"host": "host", "port": "port", "api_key": "api_key", "shutdown_grace": "shutdown_grace_s",
                 "api_server_count": "api_server_count"}
"""argparse dest -> ServerConfig field."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    defaults = {f.name: f.default for f in fields(ServerConfig)}
    group = parser.add_argument_group("server")
    group.add_argument("--host", help=f"address to bind (default {defaults['host']})")
    group.add_argument("--port", type=int, help=f"port to bind, 0 for any free one (default {defaults['port']})")
    group.add_argument("--api-key", help="require `Authorization: Bearer <key>` on /v1/*")
    group.add_argument("--shutdown-grace", type=float, metavar="SECONDS",
                       help="on SIGTERM, time in-flight requests get to finish "
                            f"(default {defaults['shutdown_grace_s']})")
    group.add_argument("--api-server-count", type=int, metavar="N",
                       help="API-server processes sharing the port, talking to the one engine core "
                            f"(default {defaults['api_server_count']})")


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The ServerConfig the flags describe; a ConfigError names the flag (`--shutdown-grace`), not the field."""
    given = {field: getattr(args, dest) for dest, field in _SERVER_FLAGS.items()
             if getattr(args, dest, None) is not None}
    try:
        return ServerConfig(**given)
    except ConfigError as error:
        message = str(error)
        for dest, field in _SERVER_FLAGS.items():
            message = re.sub(rf"\b{field}\b", "--" + dest.replace("_", "-"), message)
        raise ConfigError(message) from None


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


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    # Tokenize on the calling worker thread (engine.async_tokenizer lowers the large-text lane's
    # priority), not on the tokenizers library's own thread pool, which would run at normal priority.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    engine_config = engine_config_from_args(args)
    try:
        server_config = server_config_from_args(args)
    except ConfigError as error:
        print(f"conveyor serve: error: {error}", file=sys.stderr)
        return 2
    prometheus_client.disable_created_metrics()  # as vLLM: no `*_created` series
    engine_config = leave_cores_to_api_servers(engine_config, server_config.api_server_count)
    if server_config.api_server_count > 1:
        from conveyor.server.api_servers import run_api_servers

        return run_api_servers(engine_config, server_config)
    try:
        engine = EngineProcess.start(engine_config)
    except EngineStartupError as error:
        print(f"conveyor serve: error: the engine failed to start: {error}", file=sys.stderr)
        return 1
    assert engine.info is not None
    log_startup(engine.info)
    try:
        code = asyncio.run(_serve_with_engine(engine, engine_config, server_config))
    finally:
        engine_code = engine.shutdown()
    if code == 0 and engine_code not in (0, None):
        logger.error("the engine core exited with code %s", engine_code)
        return 1
    return code


def leave_cores_to_api_servers(engine_config: EngineConfig, api_server_count: int) -> EngineConfig:
    """On CPU, without --num-threads, the engine process gets the cores minus one per API server (as vLLM
    CPU keeps a core for its API server): torch's default, one thread per core, makes the step loop's
    OpenMP threads fight the API process for the cores, and every parallel region waits for the thread
    that lost (measured on 2 cores: median ITL 0.27-0.34 s against 0.09-0.11 s with one thread)."""
    if engine_config.device.device != "cpu" or engine_config.device.num_threads is not None:
        return engine_config
    num_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    num_threads = max(1, num_cores - api_server_count)
    logger.info("CPU: the engine core uses %d torch thread(s), leaving %d core(s) to the API server(s) "
                "(--num-threads overrides)", num_threads, num_cores - num_threads)
    return with_overrides(engine_config, "device", num_threads=num_threads)


async def _serve_with_engine(engine: EngineProcess, engine_config: EngineConfig, server_config: ServerConfig) -> int:
    assert engine.info is not None
    client_config = ClientConfig.for_engine(engine_config, engine.info, engine.addresses)
    client = AsyncEngineClient.connect(client_config, engine_config, lifeline=engine.lifeline)
    return await serve(client, server_config)


def log_startup(info: EngineInfo) -> None:
    config = " ".join(f"--{key}={value}" for key, value in sorted(info.config.items()))
    logger.info("resolved config: %s", config)
    logger.info("KV cache: %d blocks x %d tokens = %d tokens; max concurrency at max_model_len=%d: %.2f requests",
                info.num_kv_blocks, info.block_size, info.num_kv_tokens, info.max_model_len, info.max_concurrency)


async def serve(engine: EngineClient, server_config: ServerConfig, options: ServeOptions = ServeOptions()) -> int:
    """Serve until a signal (drain, then stop) or the engine's death; then let go of the engine.
    Returns the exit status: 0 after a drain, 1 when the engine died."""
    app = build_app(engine, server_config, options.metrics_dir)
    config = uvicorn.Config(app, host=server_config.host, port=server_config.port, log_level="info",
                            access_log=False, lifespan="off", timeout_graceful_shutdown=UVICORN_SHUTDOWN_TIMEOUT_S)
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


async def _when_started(server: uvicorn.Server, model_name: str, options: ServeOptions) -> None:
    """Log the URL once bound (the real port, when --port 0 picked one)."""
    while not server.started:
        await asyncio.sleep(0.05)
    if options.on_started is not None:
        options.on_started()
    if options.announce:
        host, port = server.servers[0].sockets[0].getsockname()[:2]
        logger.info("serving %s at http://%s:%d/v1 (health: /health, metrics: /metrics)", model_name, host, port)
