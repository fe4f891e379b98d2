"""Starting and stopping the engine-core process, from the launching (API-server) process.

`EngineProcess.start` makes the ipc:// endpoints in a private temporary directory, spawns the core
(multiprocessing "spawn": CUDA cannot survive a fork, and the child imports torch, the parent never
does), and waits for its one handshake message: `EngineReady` with the `EngineInfo` it resolved, or
`EngineStartupFailed` with a message for the user (raised here as `EngineStartupError`), or the
process dying without a word. A lifeline pipe is made at the same time: the engine holds its only
write end, so a front end holding a read end sees EOF the moment the engine process is gone, however
it went (kill -9, OOM killer, segfault).

`run_engine_core` is the child's entry point: it ignores SIGINT/SIGTERM (the launcher drains the front
ends first, then sends `ShutdownEngine`), builds the core, binds its sockets, answers the handshake
and runs the loop.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import multiprocessing.connection
import multiprocessing.process
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

from conveyor.config import EngineConfig
from conveyor.engine.args import fields_to_flags
from conveyor.engine.core_proc import EngineAddresses, EngineCoreProc, watch_parent
from conveyor.engine.engine_core import EngineCore
from conveyor.engine.messages import (
    EngineReady,
    EngineStartupFailed,
    ShutdownEngine,
    encoder,
    handshake_decoder,
)
from conveyor.engine.types import EngineInfo

if TYPE_CHECKING:
    from conveyor.worker.tp_executor import RankFailure

logger = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"
HANDSHAKE_POLL_MS = 200
"""How often the launcher checks that the engine process is still alive while it loads."""
SHUTDOWN_TIMEOUT_S = 10.0
"""After ShutdownEngine, how long the engine may take to exit before it is killed."""
ENGINE_PROCESS_NAME = "EngineCore"
RANK_FAILURE_GRACE_S = 5.0
"""After a tensor-parallel rank dies, how long the loop may take to stop on its own (EngineDead to the
front ends) before the process exits anyway (a collective stuck in a GPU kernel cannot be interrupted)."""


class EngineStartupError(RuntimeError):
    """The engine core could not start; the message is for the user."""


@dataclass(frozen=True)
class EngineProcessConfig:
    """What the engine-core process is started with."""

    engine_config: EngineConfig
    """The user's configuration (the core strips the front end's admission caps itself)."""
    addresses: EngineAddresses
    """Where to bind, and where to answer the handshake."""
    log_level: int = logging.INFO
    """The child's logging level (it configures logging itself: spawn starts from nothing)."""


def make_addresses(num_clients: int) -> tuple[EngineAddresses, str]:
    """ipc:// endpoints in a fresh private directory (returned too, for removal at shutdown)."""
    directory = tempfile.mkdtemp(prefix="conveyor-")
    outputs = tuple(f"ipc://{directory}/output-{i}" for i in range(num_clients))
    return EngineAddresses(f"ipc://{directory}/input", outputs, f"ipc://{directory}/handshake"), directory


class EngineProcess:
    """The launcher's handle on the engine-core process."""

    def __init__(self, process: multiprocessing.process.BaseProcess, addresses: EngineAddresses,
                 directory: str, lifeline: multiprocessing.connection.Connection) -> None:
        self.process = process
        self.addresses = addresses
        self.lifeline = lifeline
        """Read end of the lifeline: EOF once the engine process is gone (hand it to a front end)."""
        self.info: EngineInfo | None = None
        self._directory = directory

    @classmethod
    def start(cls, engine_config: EngineConfig, num_clients: int = 1) -> EngineProcess:
        """Spawn the core and wait until it is ready (raises EngineStartupError)."""
        addresses, directory = make_addresses(num_clients)
        context = multiprocessing.get_context("spawn")
        reader, writer = context.Pipe(duplex=False)
        config = EngineProcessConfig(engine_config, addresses, logging.getLogger().getEffectiveLevel())
        process = context.Process(target=run_engine_core, args=(config, writer), name=ENGINE_PROCESS_NAME)
        zmq_context = zmq.Context()
        handshake = zmq_context.socket(zmq.PULL)
        handshake.bind(addresses.handshake)
        process.start()
        writer.close()  # the engine now holds the only write end
        engine = cls(process, addresses, directory, reader)
        try:
            engine.info = engine._wait_ready(handshake)
        except BaseException:
            engine.kill()
            raise
        finally:
            handshake.close(linger=0)
            zmq_context.term()
        return engine

    def _wait_ready(self, handshake: zmq.Socket) -> EngineInfo:
        decode = handshake_decoder().decode
        while not handshake.poll(HANDSHAKE_POLL_MS):
            if not self.process.is_alive():
                raise EngineStartupError(f"the engine process exited with code {self.process.exitcode} "
                                         "during start-up (see its log above)")
        message = decode(handshake.recv())
        if isinstance(message, EngineStartupFailed):
            self.process.join(timeout=SHUTDOWN_TIMEOUT_S)
            raise EngineStartupError(fields_to_flags(message.message))  # the flags the user typed
        return message.info

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> int | None:
        """Ask the core to stop (it aborts what is left), wait, kill if it does not; returns its exit code."""
        if self.process.is_alive():
            context = zmq.Context()
            socket = context.socket(zmq.PUSH)
            socket.connect(self.addresses.input)
            socket.send(encoder().encode(ShutdownEngine()))
            socket.close(linger=int(timeout_s * 1000))
            context.term()
            self.process.join(timeout=timeout_s)
        if self.process.is_alive():
            logger.warning("the engine core did not stop within %.0f s; killing it", timeout_s)
            self.kill()
        self._cleanup()
        return self.process.exitcode

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=SHUTDOWN_TIMEOUT_S)
        self._cleanup()

    def _cleanup(self) -> None:
        shutil.rmtree(self._directory, ignore_errors=True)


def run_engine_core(config: EngineProcessConfig, lifeline: multiprocessing.connection.Connection) -> None:
    """The engine-core process (spawn target). `lifeline` is held, never written: it closes when we die."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=config.log_level, format=LOG_FORMAT)
    context = zmq.Context()
    handshake = context.socket(zmq.PUSH)
    handshake.connect(config.addresses.handshake)
    try:
        proc = _build(config, context)
    except Exception as error:  # noqa: BLE001 - every start-up failure is reported to the launcher
        logger.debug("engine start-up failed", exc_info=True)
        handshake.send(encoder().encode(EngineStartupFailed(_describe(error))))
        handshake.close(linger=5000)
        context.term()  # no other socket exists yet: this returns once the message is out
        _exit(1)
    handshake.send(encoder().encode(EngineReady(proc.info)))
    handshake.close(linger=5000)
    watch_parent(proc.loop.input_queue)
    try:
        proc.loop.run()
    except BaseException:  # noqa: BLE001 - logged, and EngineDead sent, by the loop
        _exit(1)
    proc.core.shutdown()
    logger.info("engine core stopped")
    del lifeline
    _exit(0)


def _exit(code: int) -> None:
    """Leave without interpreter teardown: zmq's context would wait forever on the I/O threads' sockets."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@dataclass(frozen=True)
class _Built:
    loop: EngineCoreProc
    info: EngineInfo
    core: EngineCore


class _RankFailureHandler:
    """A dead tensor-parallel rank fails the loop (EngineDead to every front end, exit 1); if the loop is
    stuck in a device kernel, the process exits after RANK_FAILURE_GRACE_S anyway."""

    def __init__(self) -> None:
        self.loop: EngineCoreProc | None = None

    def __call__(self, failure: RankFailure) -> None:  # on the executor's monitor thread
        if self.loop is not None:
            self.loop.fail(failure.describe())
        time.sleep(RANK_FAILURE_GRACE_S)
        logger.error("%s; the engine core did not stop by itself, exiting", failure.describe())
        _exit(1)


def _build(config: EngineProcessConfig, context: zmq.Context) -> _Built:
    """Load the model and size the KV cache (the slow part), then bind the sockets."""
    from conveyor.engine.model_setup import build_engine_core, build_engine_info, core_side_config

    on_rank_failure = _RankFailureHandler()
    core = build_engine_core(core_side_config(config.engine_config), on_rank_failure=on_rank_failure)
    core.load_grammar_vocabulary()
    info = build_engine_info(core, config.engine_config)
    loop = EngineCoreProc(core, config.addresses, context)
    on_rank_failure.loop = loop
    loop.start_io_threads()
    return _Built(loop, info, core)


def _describe(error: BaseException) -> str:
    """The user's view of a start-up failure: the message, with the type when it adds something."""
    text = str(error) or type(error).__name__
    if isinstance(error, (ValueError, OSError, RuntimeError)):
        return text
    return f"{type(error).__name__}: {text}"
