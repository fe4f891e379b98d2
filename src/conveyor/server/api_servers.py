"""`--api-server-count N > 1`: N front-end processes on one port, all talking to the one engine core.

Model (vLLM's APIServerProcessManager): the launching process binds the listening socket once and
hands it to N spawned front ends (each accepts on the same socket; the kernel spreads connections),
each with its own identity toward the core (`client_index` i: its own output socket, so outputs are
routed to the front end that owns the request). The launcher itself serves nothing; it owns the
signals: SIGTERM/SIGINT become SIGUSR1 to every front end (each drains exactly like a single server),
and once all have exited the engine is told to stop. The front ends ignore SIGINT/SIGTERM, so a
signal sent to the whole process group still drains once. If the engine or any front end dies, the
others are stopped and the launcher exits 1; if the launcher dies, the front ends and the engine
notice (parent sentinel) and exit.

Shared state: the admission counts (`engine.admission.SharedCounts`: the caps are global) and
prometheus_client's multiprocess directory (counters summed, engine gauges written by front end 0).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from dataclasses import dataclass

from conveyor.config import EngineConfig
from conveyor.engine.admission import SharedCounts, make_shared_counts
from conveyor.engine.client_config import ClientConfig
from conveyor.engine.core_client import AsyncEngineClient
from conveyor.engine.core_proc import EngineAddresses
from conveyor.engine.generation_defaults import NO_SAMPLING_DEFAULTS, SamplingDefaults
from conveyor.engine.launcher import LOG_FORMAT, EngineProcess, EngineStartupError
from conveyor.engine.types import EngineInfo
from conveyor.server.front_end import ServeOptions, log_startup, serve
from conveyor.server.server_config import ServerConfig

logger = logging.getLogger("conveyor.serve")
DRAIN_SIGNAL = signal.SIGUSR1
"""The launcher's order to a front end: drain, then exit (a second one: stop now)."""
FRONT_END_EXIT_TIMEOUT_S = 10.0
"""After the engine died or a front end failed, how long the others get to exit before they are killed."""


@dataclass(frozen=True)
class FrontEndSpec:
    """Everything a spawned front end needs."""

    engine_config: EngineConfig
    server_config: ServerConfig
    info: EngineInfo
    addresses: EngineAddresses
    client_index: int
    shared: SharedCounts | None
    """The global admission counts (None: no cap configured)."""
    metrics_dir: str
    """prometheus_client's multiprocess directory."""
    sampling_defaults: SamplingDefaults = NO_SAMPLING_DEFAULTS
    """The model's default sampling parameters, read once by the launcher (--generation-config)."""


def run_api_servers(engine_config: EngineConfig, server_config: ServerConfig,
                    sampling_defaults: SamplingDefaults = NO_SAMPLING_DEFAULTS) -> int:
    """Start the engine and N front ends; supervise until a signal or a death. Returns the exit status."""
    count = server_config.api_server_count
    metrics_dir = tempfile.mkdtemp(prefix="conveyor-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # read by prometheus_client in the children
    try:
        engine = EngineProcess.start(engine_config, num_clients=count)
    except EngineStartupError as error:
        print(f"conveyor serve: error: the engine failed to start: {error}", file=sys.stderr)
        shutil.rmtree(metrics_dir, ignore_errors=True)
        return 1
    assert engine.info is not None
    log_startup(engine.info, sampling_defaults)
    listener = socket.create_server((server_config.host, server_config.port), reuse_port=False, backlog=2048)
    spec = FrontEndSpec(engine_config, server_config, engine.info, engine.addresses, 0, None, metrics_dir,
                        sampling_defaults)
    try:
        return _supervise(engine, listener, spec)
    finally:
        listener.close()
        engine.shutdown()
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _supervise(engine: EngineProcess, listener: socket.socket, base: FrontEndSpec) -> int:
    """Spawn the front ends (`base` with each one's index and the shared counts) and wait."""
    assert engine.info is not None
    server_config = base.server_config
    caps = base.engine_config.scheduler
    shared = make_shared_counts(server_config.api_server_count) \
        if caps.max_num_queued_reqs is not None or caps.max_num_queued_tokens is not None else None
    context = multiprocessing.get_context("spawn")
    front_ends, ready = [], []
    for index in range(server_config.api_server_count):
        spec = dataclasses.replace(base, client_index=index, shared=shared)
        reader, writer = context.Pipe(duplex=False)
        process = context.Process(target=run_front_end, args=(spec, engine.lifeline, listener, writer),
                                  name=f"APIServer-{index}")
        process.start()
        writer.close()
        front_ends.append(process)
        ready.append(reader)
    stop = _SignalRelay(front_ends)
    if not _wait_ready(ready, front_ends, engine):
        stop.forward()
        return _finish(front_ends, engine, failed=True)
    host, port = listener.getsockname()[:2]
    logger.info("serving %s at http://%s:%d/v1 with %d API servers (health: /health, metrics: /metrics)",
                engine.info.model_name, host, port, len(front_ends))
    sentinels = [p.sentinel for p in front_ends] + [engine.process.sentinel]
    multiprocessing.connection.wait(sentinels)  # the first exit: drained after a signal, or a death
    failed = stop.count == 0 or not engine.is_alive() or any(p.exitcode not in (None, 0) for p in front_ends)
    if failed:
        logger.error("a front end or the engine core exited unexpectedly; stopping the others")
        stop.forward()
    return _finish(front_ends, engine, failed)


def _wait_ready(ready: list[multiprocessing.connection.Connection], front_ends: list[multiprocessing.process.BaseProcess],
                engine: EngineProcess) -> bool:
    pending = list(ready)
    while pending:
        waitables = pending + [p.sentinel for p in front_ends] + [engine.process.sentinel]
        for item in multiprocessing.connection.wait(waitables):
            if item in pending:
                try:
                    item.recv()
                except EOFError:
                    return False
                pending.remove(item)
            else:
                return False
    return True


def _finish(front_ends: list[multiprocessing.process.BaseProcess], engine: EngineProcess, failed: bool) -> int:
    for process in front_ends:
        process.join(timeout=None if not failed else FRONT_END_EXIT_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join()
    failed = failed or any(p.exitcode != 0 for p in front_ends)
    return 1 if failed else 0


class _SignalRelay:
    """SIGTERM/SIGINT to the launcher -> DRAIN_SIGNAL to every live front end."""

    def __init__(self, front_ends: list[multiprocessing.process.BaseProcess]) -> None:
        self._front_ends = front_ends
        self.count = 0
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, sig: int, _frame: object) -> None:
        self.count += 1
        logger.info("%s: draining %d API servers", signal.Signals(sig).name, len(self._front_ends))
        self.forward()

    def forward(self) -> None:
        for process in self._front_ends:
            if process.is_alive() and process.pid is not None:
                os.kill(process.pid, DRAIN_SIGNAL)


def run_front_end(spec: FrontEndSpec, lifeline: multiprocessing.connection.Connection, listener: socket.socket,
                  ready: multiprocessing.connection.Connection) -> None:
    """A spawned front end (spawn target): serve on the shared socket until drained or the engine dies."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    import prometheus_client

    prometheus_client.disable_created_metrics()
    _watch_parent()
    code = asyncio.run(_serve_front_end(spec, lifeline, listener, ready))
    logging.shutdown()
    os._exit(code)  # zmq's context teardown must not hold the exit


async def _serve_front_end(spec: FrontEndSpec, lifeline: multiprocessing.connection.Connection,
                           listener: socket.socket, ready: multiprocessing.connection.Connection) -> int:
    client_config = dataclasses.replace(
        ClientConfig.for_engine(spec.engine_config, spec.info, spec.addresses, spec.client_index),
        chat_template=spec.server_config.chat_template, grammar=spec.server_config.grammar_limits())
    client = AsyncEngineClient.connect(client_config, spec.engine_config, spec.shared, lifeline)
    options = ServeOptions(sockets=[listener], drain_signals=(DRAIN_SIGNAL,), metrics_dir=spec.metrics_dir,
                           announce=False, on_started=lambda: ready.send(True),
                           sampling_defaults=spec.sampling_defaults)
    return await serve(client, spec.server_config, options)


def _watch_parent() -> None:
    """The launcher died (kill -9): nothing will tell us to stop, so stop now."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def wait() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=wait, name="api-server-parent-watch", daemon=True).start()
