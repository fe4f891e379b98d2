"""`conveyor serve [MODEL]`: the OpenAI-compatible server, with vLLM's engine flags.

The engine flags come from `conveyor.engine.args` (stdlib only, shared with `conveyor generate`);
the engine itself (torch) is imported inside `run`, so importing this module stays light. One uvicorn
worker: the engine runs on its own thread beside the event loop. SIGTERM drains (see
`lifecycle.DrainingServer`) and the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import sys
from dataclasses import fields

import prometheus_client
import uvicorn

from conveyor.config import ConfigError, ServerConfig
from conveyor.engine.args import add_engine_arguments, engine_config_from_args
from conveyor.engine.types import EngineClient, EngineInfo
from conveyor.server.app import build_app
from conveyor.server.lifecycle import DrainingServer

logger = logging.getLogger("conveyor.serve")
UVICORN_SHUTDOWN_TIMEOUT_S = 2.0
"""After the drain, how long uvicorn waits for connections before cancelling what is left."""
_SERVER_FLAGS = {"host": "host", "port": "port", "api_key": "api_key", "shutdown_grace": "shutdown_grace_s"}
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


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine_config = engine_config_from_args(args)
    try:
        server_config = server_config_from_args(args)
    except ConfigError as error:
        print(f"conveyor serve: error: {error}", file=sys.stderr)
        return 2
    from conveyor.engine.async_engine import AsyncEngine  # loads torch: only now

    prometheus_client.disable_created_metrics()  # as vLLM: no `*_created` series
    engine = AsyncEngine.from_config(engine_config)
    log_startup(engine.info)
    asyncio.run(serve(engine, server_config))
    return 0


def log_startup(info: EngineInfo) -> None:
    config = " ".join(f"--{key}={value}" for key, value in sorted(info.config.items()))
    logger.info("resolved config: %s", config)
    logger.info("KV cache: %d blocks x %d tokens = %d tokens; max concurrency at max_model_len=%d: %.2f requests",
                info.num_kv_blocks, info.block_size, info.num_kv_tokens, info.max_model_len, info.max_concurrency)


async def serve(engine: EngineClient, server_config: ServerConfig) -> None:
    """Serve until a signal (drain, then stop); then stop the engine."""
    app = build_app(engine, server_config)
    config = uvicorn.Config(app, host=server_config.host, port=server_config.port, log_level="info",
                            access_log=False, lifespan="off", timeout_graceful_shutdown=UVICORN_SHUTDOWN_TIMEOUT_S)
    server = DrainingServer(config, app.state.ctx.gate, server_config.shutdown_grace_s)
    announce = asyncio.ensure_future(_announce(server, engine.info.model_name))
    try:
        await server.serve()
    finally:
        announce.cancel()
        await engine.shutdown()
    logger.info("server stopped")


async def _announce(server: uvicorn.Server, model_name: str) -> None:
    """Log the URL once bound (the real port, when --port 0 picked one)."""
    while not server.started:
        await asyncio.sleep(0.05)
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    logger.info("serving %s at http://%s:%d/v1 (health: /health, metrics: /metrics)", model_name, host, port)
