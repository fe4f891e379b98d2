"""Tensor parallelism, the driver's side: start ranks 1 .. N-1, drive them step by step, bring them down.

`TensorParallelExecutor` is what the engine holds instead of a `ModelRunner` when
--tensor-parallel-size N > 1. Rank 0's runner lives in this (the engine's) process; ranks 1 .. N-1 are
spawned processes (worker/parallel.py has their side and the start-up order). `launch` pickles the
step's `SchedulerOutput` once, writes it to every rank's pipe, then launches rank 0's step; `collect`
is rank 0's. The engine sees one runner: the same `execute` / `launch` / `collect`, the same
`initialize_kv_cache` (whose block count is the group's minimum).

Failures: a monitor thread waits on the ranks' process sentinels. When a rank dies (crash, OOM kill,
kill -9) it records the failure, logs it, terminates the other ranks -- so a collective rank 0 is
waiting in fails (gloo sees its peers' sockets close) instead of waiting forever -- and calls the
`on_failure` handler if one was given. From then on every call raises `RankFailedError` naming the
rank. A collective inside a CUDA kernel (NCCL) cannot be interrupted, so a server passes a handler
that stops its loop and ends the process after a grace period (engine/launcher.py): the front end
then reports the engine dead and errors out every request, and nothing hangs. Each rank in turn watches a lifeline
pipe and exits when this process is gone, however it went.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from conveyor.config import EngineConfig
from conveyor.core.outputs import ModelRunnerOutput, SchedulerOutput
from conveyor.model.loader import read_arch_config
from conveyor.model.parallel_layers import TensorParallelGroup
from conveyor.model.registry import ModelArchConfig
from conveyor.model.tensor_parallel import (
    FLAG,
    TensorParallelError,
    check_tensor_parallel,
    tensor_parallel_quantization,
)
from conveyor.worker.kv_cache import KVCapacity
from conveyor.worker.parallel import (
    GROUP_TIMEOUT,
    STORE_HOST,
    Execute,
    GroupSetup,
    InitializeKVCache,
    JoinGroup,
    RankCommand,
    RankFailed,
    RankKVReady,
    RankLoaded,
    RankSetup,
    Shutdown,
    TensorParallelModelRunner,
    join_group,
    leave_group,
    rank_engine_config,
    run_rank,
)
from conveyor.worker.step_handle import StepHandle

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 10.0
"""How long a rank may take to leave after Shutdown before it is terminated."""
FAILURE_NOTICE_S = 2.0
"""After a collective fails, how long to wait for the monitor to name the rank that died."""

Reply = TypeVar("Reply", RankLoaded, RankKVReady)


class RankFailedError(RuntimeError):
    """A tensor-parallel rank died or failed; the engine cannot go on."""


@dataclass(frozen=True)
class RankFailure:
    """A rank process that ended while the group was running."""

    rank: int
    pid: int | None
    exitcode: int | None
    """The process's exit code (negative: killed by that signal)."""

    def describe(self) -> str:
        how = f"was killed by signal {-self.exitcode}" if self.exitcode and self.exitcode < 0 else \
            f"exited with code {self.exitcode}"
        return f"tensor-parallel rank {self.rank} (pid {self.pid}) {how}"


FailureHandler = Callable[[RankFailure], None]


@dataclass
class _Rank:
    rank: int
    process: multiprocessing.process.BaseProcess
    commands: multiprocessing.connection.Connection
    lifeline: multiprocessing.connection.Connection
    """Write end, never written: the rank sees EOF when this process is gone."""


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def check_parallel_setup(config: EngineConfig, arch: ModelArchConfig) -> None:
    """Refuse, naming the flag, what cannot run: a split the model does not allow, more ranks than GPUs,
    a second group in this process. More ranks than CPU cores is allowed, with a warning."""
    world_size = config.parallel.tensor_parallel_size
    check_tensor_parallel(arch, world_size)
    tensor_parallel_quantization(config.model.quantization)
    if dist.is_initialized():
        raise TensorParallelError(f"{FLAG} {world_size}: this process already belongs to a process group")
    if config.device.device == "cuda":
        visible = torch.cuda.device_count()
        if visible < world_size or not dist.is_nccl_available():
            raise TensorParallelError(f"{FLAG} {world_size} needs {world_size} GPUs with NCCL; {visible} visible "
                                      "(CUDA_VISIBLE_DEVICES chooses them)")
    elif world_size > usable_cores():
        logger.warning("%s %d on %d CPU cores: the ranks share cores (one thread each) and run slower than "
                       "fewer ranks would", FLAG, world_size, usable_cores())


class TensorParallelExecutor:
    """Rank 0 here, ranks 1 .. N-1 in processes; to the engine, one model runner."""

    def __init__(self, config: EngineConfig, on_failure: FailureHandler | None = None) -> None:
        check_parallel_setup(config, read_arch_config(config.model))
        config = rank_engine_config(config, usable_cores())
        self.world_size = config.parallel.tensor_parallel_size
        self.failure: RankFailure | None = None
        """The first rank that died, once one has."""
        self._on_failure = on_failure
        self._device_type = config.device.device
        self._closing = False
        self._ranks: list[_Rank] = []
        self._store = dist.TCPStore(STORE_HOST, 0, self.world_size, is_master=True, timeout=GROUP_TIMEOUT,
                                    wait_for_workers=False)
        try:
            self._spawn(config)
            threading.Thread(target=self._watch, name="tp-monitor", daemon=True).start()
            if config.device.device == "cuda":
                torch.cuda.set_device(0)
            self.runner = TensorParallelModelRunner(config, TensorParallelGroup(0, self.world_size))
            """Rank 0's runner (its model, KV cache and request states)."""
            self._expect(RankLoaded)
            self._send(JoinGroup())
            join_group(GroupSetup(0, self.world_size, self._store.port), config.device.device, self._store)
        except BaseException:
            self.shutdown()
            raise

    def _spawn(self, config: EngineConfig) -> None:
        context = multiprocessing.get_context("spawn")  # CUDA does not survive fork
        level = logging.getLogger().getEffectiveLevel()
        for rank in range(1, self.world_size):
            ours, theirs = context.Pipe(duplex=True)
            life_read, life_write = context.Pipe(duplex=False)
            setup = RankSetup(config, GroupSetup(rank, self.world_size, self._store.port), level)
            process = context.Process(target=run_rank, args=(setup, theirs, life_read), name=f"TPRank{rank}",
                                      daemon=True)
            process.start()
            theirs.close()
            life_read.close()
            self._ranks.append(_Rank(rank, process, ours, life_write))

    @property
    def rank_pids(self) -> list[int | None]:
        """Process ids of ranks 1 .. N-1."""
        return [rank.process.pid for rank in self._ranks]

    # The engine's runner interface -------------------------------------------------------------

    @property
    def max_position_embeddings(self) -> int:
        return self.runner.max_position_embeddings

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.runner.eos_token_ids

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    def initialize_kv_cache(self) -> KVCapacity:
        """Every rank sizes, agrees (minimum), allocates, captures and warms up, together."""
        self._send(InitializeKVCache())
        capacity = self._guarded(self.runner.initialize_kv_cache)
        for reply in self._expect(RankKVReady):
            if reply.num_blocks != capacity.num_blocks:
                raise RankFailedError(f"ranks disagree on the KV block count ({reply.num_blocks} vs "
                                      f"{capacity.num_blocks})")
        return capacity

    def launch(self, scheduler_output: SchedulerOutput) -> StepHandle:
        """Send the step to every rank, then launch rank 0's part of it."""
        self._send(Execute(scheduler_output))
        return self._guarded(lambda: self.runner.launch(scheduler_output))

    def collect(self, handle: StepHandle) -> ModelRunnerOutput:
        return self._guarded(lambda: self.runner.collect(handle))

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.collect(self.launch(scheduler_output))

    # Plumbing ----------------------------------------------------------------------------------

    def _send(self, command: RankCommand) -> None:
        """One pickle, written to every rank's pipe."""
        self._raise_if_failed()
        payload = ForkingPickler.dumps(command)
        for rank in self._ranks:
            try:
                rank.commands.send_bytes(payload)
            except OSError as error:
                raise self._failure_error(error) from error

    def _guarded(self, call: Callable[[], Any]) -> Any:
        """Run rank 0's part; a collective that fails because a peer died raises RankFailedError."""
        self._raise_if_failed()
        try:
            return call()
        except (RuntimeError, OSError) as error:
            raise self._failure_error(error) from error

    def _expect(self, reply_type: type[Reply]) -> list[Reply]:
        """One reply of `reply_type` from every rank, in rank order; a death or RankFailed raises."""
        replies = []
        for rank in self._ranks:
            ready = multiprocessing.connection.wait([rank.commands, rank.process.sentinel])
            if rank.commands not in ready and not rank.commands.poll():
                rank.process.join(timeout=1.0)
                failure = RankFailure(rank.rank, rank.process.pid, rank.process.exitcode)
                raise RankFailedError(f"{failure.describe()} during start-up (see its log above)")
            reply = rank.commands.recv()
            if isinstance(reply, RankFailed):
                raise RankFailedError(reply.message)
            if not isinstance(reply, reply_type):
                raise RankFailedError(f"rank {rank.rank} answered {reply!r}, expected {reply_type.__name__}")
            replies.append(reply)
        return replies

    def _raise_if_failed(self) -> None:
        if self.failure is not None:
            raise RankFailedError(f"{self.failure.describe()}; the tensor-parallel group is down")

    def _failure_error(self, error: BaseException) -> RankFailedError:
        """The error to raise for a failed collective or pipe: the dead rank's name once the monitor has it."""
        deadline = time.monotonic() + FAILURE_NOTICE_S
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(0.01)
        for rank in self._ranks:
            reply = _last_word(rank.commands)  # a rank that failed in a command said why before it exited
            if isinstance(reply, RankFailed):
                return RankFailedError(reply.message)
        cause = self.failure.describe() if self.failure is not None else "a tensor-parallel collective failed"
        return RankFailedError(f"{cause}: {type(error).__name__}: {error}")

    def _watch(self) -> None:
        """The monitor thread: the first rank to end while not shutting down fails the group."""
        sentinels = {rank.process.sentinel: rank for rank in self._ranks}
        if not sentinels:  # world size 1: nothing to watch
            return
        ready = multiprocessing.connection.wait(list(sentinels))
        if self._closing:
            return
        dead = sentinels[ready[0]]
        dead.process.join(timeout=1.0)
        self.failure = RankFailure(dead.rank, dead.process.pid, dead.process.exitcode)
        logger.error("%s; stopping the other ranks", self.failure.describe())
        for rank in self._ranks:
            if rank.process.is_alive():
                rank.process.terminate()
        if self._on_failure is not None:
            self._on_failure(self.failure)

    def shutdown(self) -> None:
        """Stop every rank (Shutdown, then terminate what is left) and leave the group. Idempotent."""
        if self._closing:
            return
        self._closing = True
        for rank in self._ranks:
            try:
                rank.commands.send(Shutdown())
            except OSError:
                pass
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
        for rank in self._ranks:
            rank.process.join(timeout=max(0.0, deadline - time.monotonic()))
            if rank.process.is_alive():
                rank.process.terminate()
                rank.process.join(timeout=1.0)
            rank.commands.close()
            rank.lifeline.close()
        if self.failure is None or self._device_type == "cpu":  # a failed NCCL group may block its teardown
            leave_group()

    def __enter__(self) -> TensorParallelExecutor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


def _last_word(connection: multiprocessing.connection.Connection) -> object:
    """What a rank left in its pipe, if anything (a pipe whose rank was killed reads as reset or EOF)."""
    try:
        return connection.recv() if connection.poll() else None
    except (EOFError, OSError):
        return None
