"""`conveyor serve [MODEL]`: the OpenAI-compatible server, with vLLM's engine flags, in two kinds of process.

`run` starts the engine-core process (`engine.launcher.EngineProcess`: model, scheduler, KV cache;
the only process that imports torch), waits for its READY handshake (a start-up failure is printed
as one line and the command exits 1), then serves HTTP from this process (`server.front_end`;
`--api-server-count 1`, the default) or from N spawned front-end processes sharing one listening socket
(`server.api_servers`). SIGTERM drains (see `lifecycle.DrainingServer`), then the engine is told to
stop and the command exits 0; if the engine dies, the server stops at once and exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys

import prometheus_client

from conveyor.config import ConfigError, EngineConfig
from conveyor.engine.args import add_engine_arguments, engine_config_from_args, with_overrides
from conveyor.engine.client_config import ClientConfig
from conveyor.engine.core_client import AsyncEngineClient
from conveyor.engine.generation_defaults import SamplingDefaults, sampling_defaults_of
from conveyor.engine.launcher import LOG_FORMAT, EngineProcess, EngineStartupError
from conveyor.engine.model_files import tokenizer_path
from conveyor.engine.tokenizer import TokenizerError, tokenizer_source
from conveyor.engine.vllm_flags import check_vllm_flags, register_vllm_flags
from conveyor.engine.vllm_flags import preprocess_argv as _vllm_preprocess
from conveyor.server.api_servers import run_api_servers
from conveyor.server.front_end import ServeOptions, log_startup, serve
from conveyor.server.server_args import add_server_arguments, check_model_is_local, server_config_from_args
from conveyor.server.server_config import ServerConfig

logger = logging.getLogger("conveyor.serve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    add_server_arguments(parser)
    register_vllm_flags(parser)  # every other `vllm serve` flag: accepted, warned about or refused by name
    parser.epilog = ("Every flag of `vllm serve` is accepted: implemented, ignored with a warning, or refused "
                     "with the reason (the table is in docs/serving.md).")


def preprocess_argv(argv: list[str]) -> list[str]:  # noqa: F811 - conveyor.cli's hook for this subcommand
    """vLLM's spellings (`--config FILE`, `--max_model_len`, `-O3`, dotted JSON keys) as plain flags."""
    return _vllm_preprocess(argv)


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
    try:  # before the engine spends its start-up loading a model that could never be served
        tokenizer_source(tokenizer_path(engine_config.model))
        sampling_defaults = sampling_defaults_of(engine_config.model)  # read once, here (the front end)
    except (TokenizerError, FileNotFoundError, ConfigError) as error:
        print(f"conveyor serve: error: {error}", file=sys.stderr)
        return 2
    prometheus_client.disable_created_metrics()  # as vLLM: no `*_created` series
    engine_config = leave_cores_to_api_servers(engine_config, server_config.api_server_count)
    if server_config.api_server_count > 1:
        return run_api_servers(engine_config, server_config, sampling_defaults)
    try:
        engine = EngineProcess.start(engine_config)
    except EngineStartupError as error:
        print(f"conveyor serve: error: the engine failed to start: {error}", file=sys.stderr)
        return 1
    assert engine.info is not None
    log_startup(engine.info, sampling_defaults)
    try:
        code = asyncio.run(_serve_with_engine(engine, engine_config, server_config, sampling_defaults))
    finally:
        engine_code = engine.shutdown()
    if code == 0 and engine_code not in (0, None):
        logger.error("the engine core exited with code %s", engine_code)
        return 1
    return code


def default_cpu_threads(num_cores: int, api_server_count: int) -> int:
    """The engine's torch threads on CPU without --num-threads: the cores the API server processes leave
    free, but at least min(cores, 2). Measured on 2 vCPUs, two threads against one (docs/performance.md,
    "The CPU thread default"): single-stream median ITL 4.7-5.2 vs 6.7-7.1 ms on an AMD EPYC, 11.8-12.2
    vs 19.3-20.6 ms on an Intel Xeon; a 40-request mix at 8 sequences done in 15.0-17.4 vs 23.2-24.9 s
    and 24.3-27.8 vs 42.5-43.4 s. So two threads beside one API server beat leaving it a whole core;
    with more cores, one per API server is still left free."""
    return max(min(num_cores, 2), num_cores - api_server_count)


def leave_cores_to_api_servers(engine_config: EngineConfig, api_server_count: int) -> EngineConfig:
    """On CPU, without --num-threads, the engine's threads by `default_cpu_threads`, shared out over the
    tensor-parallel ranks (at least one thread a rank); an explicit --num-threads always wins."""
    if engine_config.device.device != "cpu" or engine_config.device.num_threads is not None:
        return engine_config
    num_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    engine_threads = default_cpu_threads(num_cores, api_server_count)
    num_threads = max(1, engine_threads // engine_config.parallel.tensor_parallel_size)
    logger.info("CPU: the engine core uses %d torch thread(s) per rank on %d core(s), %d API server(s) "
                "(--num-threads overrides)", num_threads, num_cores, api_server_count)
    return with_overrides(engine_config, "device", num_threads=num_threads)


async def _serve_with_engine(engine: EngineProcess, engine_config: EngineConfig, server_config: ServerConfig,
                             sampling_defaults: SamplingDefaults) -> int:
    assert engine.info is not None
    client_config = dataclasses.replace(ClientConfig.for_engine(engine_config, engine.info, engine.addresses),
                                        chat_template=server_config.chat_template,
                                        grammar=server_config.grammar_limits())
    client = AsyncEngineClient.connect(client_config, engine_config, lifeline=engine.lifeline)
    return await serve(client, server_config, ServeOptions(sampling_defaults=sampling_defaults))
