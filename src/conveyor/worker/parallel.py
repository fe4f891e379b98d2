"""Tensor parallelism, one rank's side: its model runner, its process group, and the loop of a rank process.

The model: the engine's process is rank 0 and drives ranks 1 .. N-1, each a process of its own
(worker/tp_executor.py starts them). Every rank holds a `TensorParallelModelRunner`: an ordinary
`ModelRunner` whose model is the rank's shard (model/tensor_parallel.py) and whose KV cache holds only
its KV heads. For each step the driver sends the step's `SchedulerOutput` (ints, pickled over a pipe)
to every other rank and then runs the step itself; every rank therefore applies the same scheduler
output to the same request states and issues the same collectives in the same order (NCCL on CUDA,
gloo on CPU, torch.distributed's default group). Logits are all-gathered, so each rank samples the
same tokens from the same generators (the seed is the same everywhere) and keeps its request states
in step without any tokens travelling back; only rank 0's output reaches the engine. The scheduler
stays single, in the driver, and torch-free.

Start-up order, so that every failure is seen before a collective could wait on it: each rank loads
its shard and says `RankLoaded`; the driver then tells all to `JoinGroup` (the process group's
rendezvous over a TCP store on 127.0.0.1 that the driver hosts); then `InitializeKVCache` runs on
all ranks together (profiling and CUDA-graph capture run collectives), each rank sizes its cache
and the group takes the minimum (uneven head splits give ranks different block costs), so every rank
allocates the same number of blocks, which is the number the scheduler's pool gets. A rank that is
idle blocks on its pipe, not in a collective, so an idle server never meets a collective timeout.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import multiprocessing.connection
import os
import signal
import sys
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from conveyor.config import EngineConfig, ModelConfig
from conveyor.core.outputs import SchedulerOutput
from conveyor.model.loader import LoadedModel, load_model
from conveyor.model.parallel_layers import TensorParallelGroup
from conveyor.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

STORE_HOST = "127.0.0.1"
"""The rendezvous store's address: every rank runs on this host."""
GROUP_TIMEOUT = datetime.timedelta(minutes=30)
"""How long a collective or the rendezvous may wait for a peer (only ever within a step or start-up)."""
LOG_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"


@dataclass(frozen=True)
class GroupSetup:
    """Where a rank joins the process group."""

    rank: int
    """This process's rank."""
    world_size: int
    """Ranks in the group."""
    store_port: int
    """Port of the driver's TCPStore on STORE_HOST."""


@dataclass(frozen=True)
class RankSetup:
    """What a rank process is started with."""

    engine_config: EngineConfig
    """The engine's configuration (device config already resolved per rank)."""
    group: GroupSetup
    """Its place in the group."""
    log_level: int
    """The driver's logging level (a spawned process configures logging itself)."""


@dataclass(frozen=True)
class JoinGroup:
    """Command: every rank has loaded; join the process group."""


@dataclass(frozen=True)
class InitializeKVCache:
    """Command: size (group minimum), allocate, capture graphs, warm up; answer RankKVReady."""


@dataclass(frozen=True)
class Execute:
    """Command: launch this step (and collect the previous one)."""

    scheduler_output: SchedulerOutput


@dataclass(frozen=True)
class Shutdown:
    """Command: leave the loop and exit 0."""


@dataclass(frozen=True)
class RankLoaded:
    """Reply: the shard is loaded."""


@dataclass(frozen=True)
class RankKVReady:
    """Reply: the KV cache is allocated with this many blocks."""

    num_blocks: int


@dataclass(frozen=True)
class RankFailed:
    """Reply in place of any other: the rank failed, and why."""

    message: str


RankCommand = JoinGroup | InitializeKVCache | Execute | Shutdown
RankReply = RankLoaded | RankKVReady | RankFailed


class TensorParallelModelRunner(ModelRunner):
    """A ModelRunner over one rank's shard; the KV block count is the group's minimum."""

    def __init__(self, config: EngineConfig, group: TensorParallelGroup) -> None:
        self.group = group
        super().__init__(config.model, config.cache, config.scheduler, config.device)

    def _load_model(self, model_config: ModelConfig) -> LoadedModel:
        return load_model(model_config, self.device.type, self.dtype, self.attention_backend, self.group)

    def _agree_on_num_blocks(self, num_blocks: int) -> int:
        count = torch.tensor([num_blocks], dtype=torch.int64, device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MIN)
        return int(count.item())


def join_group(setup: GroupSetup, device_type: str, store: dist.Store | None = None) -> None:
    """Join the default process group (NCCL on CUDA, gloo on CPU); `store` is the driver's own."""
    if store is None:
        store = dist.TCPStore(STORE_HOST, setup.store_port, setup.world_size, is_master=False, timeout=GROUP_TIMEOUT)
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=setup.rank, world_size=setup.world_size, timeout=GROUP_TIMEOUT)
    if device_type == "cuda":  # create the NCCL communicator now: memory profiling must see its buffers
        dist.all_reduce(torch.zeros(1, device="cuda"))
        torch.cuda.synchronize()


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def run_rank(setup: RankSetup, commands: multiprocessing.connection.Connection,
             lifeline: multiprocessing.connection.Connection) -> None:
    """A rank process (spawn target): load, reply, then serve commands until Shutdown. Any failure is
    logged, reported as RankFailed when someone listens, and ends the process with exit code 1."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the driver, which shuts the ranks down
    logging.basicConfig(level=setup.log_level, format=LOG_FORMAT)
    threading.Thread(target=_watch_lifeline, args=(lifeline,), name="lifeline", daemon=True).start()
    try:
        config = setup.engine_config
        if config.device.device == "cuda":
            torch.cuda.set_device(setup.group.rank)
        runner = TensorParallelModelRunner(config, TensorParallelGroup(setup.group.rank, setup.group.world_size))
        commands.send(RankLoaded())
        serve_commands(runner, commands, setup.group)
    except Exception as error:  # noqa: BLE001 - every failure ends the rank; the driver is told if it listens
        logger.exception("tensor-parallel rank %d failed", setup.group.rank)
        _try_send(commands, RankFailed(f"rank {setup.group.rank}: {type(error).__name__}: {error}"))
        _exit(1)
    _exit(0)


def serve_commands(runner: TensorParallelModelRunner, commands: multiprocessing.connection.Connection,
                   group: GroupSetup) -> None:
    """The rank's loop. Steps are collected one behind (launch N+1, then collect N), as the driver's
    async loop does, so this rank's host work also overlaps its device work; the tokens are the same."""
    pending = None
    while True:
        command = commands.recv()  # EOFError if the driver is gone: the rank fails
        if isinstance(command, Execute):
            handle = runner.launch(command.scheduler_output)
            if pending is not None:
                runner.collect(pending)
            pending = handle
        elif isinstance(command, JoinGroup):
            join_group(group, runner.device.type)
        elif isinstance(command, InitializeKVCache):
            commands.send(RankKVReady(runner.initialize_kv_cache().num_blocks))
        elif isinstance(command, Shutdown):
            leave_group()
            return
        else:
            raise TypeError(f"unknown rank command {command!r}")


def rank_engine_config(config: EngineConfig, num_cores: int) -> EngineConfig:
    """The configuration each rank runs with: on CPU, unless --num-threads is given, the cores are
    shared out (torch's default of one thread per core in every rank would oversubscribe them)."""
    world_size = config.parallel.tensor_parallel_size
    if config.device.device != "cpu" or config.device.num_threads is not None:
        return config
    device = dataclasses.replace(config.device, num_threads=max(1, num_cores // world_size))
    return dataclasses.replace(config, device=device)


def _watch_lifeline(lifeline: multiprocessing.connection.Connection) -> None:
    """The driver holds the only write end: EOF means it is gone, even while this rank waits in a
    collective that will never complete (a CUDA kernel cannot be interrupted); leave at once."""
    try:
        lifeline.recv()
    except (EOFError, OSError):
        pass
    logger.error("the tensor-parallel driver is gone; rank exiting")
    _exit(1)


def _try_send(connection: multiprocessing.connection.Connection, reply: RankReply) -> None:
    try:
        connection.send(reply)
    except (OSError, ValueError):
        pass


def _exit(code: int) -> None:
    """Leave without interpreter teardown (a process group or CUDA context may block it)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
