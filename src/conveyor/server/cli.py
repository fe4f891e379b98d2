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
import dataclasses
import asyncio
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass

import prometheus_client
import uvicorn

from conveyor.config import ConfigError, EngineConfig
from conveyor.engine.args import add_engine_arguments, engine_config_from_args, with_overrides
from conveyor.engine.core_client import AsyncEngineClient, ClientConfig
from conveyor.engine.launcher import LOG_FORMAT, EngineProcess, EngineStartupError
from conveyor.engine.types import EngineClient, EngineInfo
from conveyor.engine.vllm_flags import check_vllm_flags, register_vllm_flags
from conveyor.engine.vllm_flags import preprocess_argv as _vllm_preprocess
from conveyor.server.app import build_app
from conveyor.server.http_guard import ConnectionLimits, guarded_protocol
from conveyor.server.lifecycle import DrainingServer
from conveyor.server.server_args import add_server_arguments, check_model_is_local, server_config_from_args
from conveyor.server.server_config import ServerConfig

logger = logging.getLogger("conveyor.serve")
UVICORN_SHUTDOWN_TIMEOUT_S = 2.0
"""After the drain, how long uvicorn waits for connections before cancelling what is left."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    add_server_arguments(parser)
    register_vllm_flags(parser)  # every other `vllm serve` flag: accepted, warned about or refused by name
    parser.epilog = ("Every flag of `vllm serve` is accepted: implemented, ignored with a warning, or refused "
                     "with the reason (the table is in docs/serving.md).")


def preprocess_argv(argv: list[str]) -> list[str]:  # noqa: F811 - conveyor.cli's hook for this subcommand
    """vLLM's spellings (`--config FILE`, `--max_model_len`, `-O3`, dotted JSON keys) as plain flags."""
    return _vllm_preprocess(argv)


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
    logging.basicConfig(level=getattr(args, "log_level", None) or logging.INFO, format=LOG_FORMAT)
    # Tokenize on the calling worker thread (engine.async_tokenizer lowers the large-text lane's
    # priority), not on the tokenizers library's own thread pool, which would run at normal priority.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        check_vllm_flags(args)
        check_model_is_local(args)
        server_config = server_config_from_args(args)
    except ConfigError as error:
        print(f"conveyor serve: error: {error}", file=sys.stderr)
        return 2
    engine_config = engine_config_from_args(args)
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
    client_config = dataclasses.replace(ClientConfig.for_engine(engine_config, engine.info, engine.addresses),
                                        chat_template=server_config.chat_template,
                                        grammar=server_config.grammar_limits())
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
