"""An engine core served over real ZeroMQ ipc sockets, on a thread of the test process (fast: no spawn).

`serving(core)` runs `EngineCoreProc` (the engine process's loop and I/O threads) over a fake or real
`EngineCore` and yields a connected `AsyncEngineClient` per front end: everything of the split except
the process boundary itself, which tests/server/test_server_e2e.py crosses with the real model.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import zmq
from engine_fakes import ByteTokenizer

from conveyor.config import EngineConfig
from conveyor.engine.admission import AdmissionControl, QueueLimits, SharedCounts
from conveyor.engine.async_tokenizer import AsyncTokenizer
from conveyor.engine.client_config import ClientConfig
from conveyor.engine.core_client import AsyncEngineClient
from conveyor.engine.core_proc import EngineCoreProc
from conveyor.engine.engine_core import EngineCore
from conveyor.engine.launcher import make_addresses
from conveyor.engine.messages import ShutdownEngine
from conveyor.engine.model_setup import build_engine_info


@dataclass
class Served:
    clients: list[AsyncEngineClient]
    proc: EngineCoreProc
    thread: threading.Thread
    errors: list[BaseException]

    @property
    def client(self) -> AsyncEngineClient:
        return self.clients[0]


@asynccontextmanager
async def serving(core: EngineCore, config: EngineConfig | None = None, num_clients: int = 1,
                  shared: SharedCounts | None = None, tokenizer=None) -> AsyncIterator[Served]:  # noqa: ANN001
    config = config or core.config
    addresses, directory = make_addresses(num_clients)
    context = zmq.Context()
    proc = EngineCoreProc(core, addresses, context)
    proc.start_io_threads()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            proc.run()
        except BaseException as error:  # noqa: BLE001 - the test inspects it
            errors.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    info = build_engine_info(core, config)
    limits = QueueLimits(config.scheduler.max_num_queued_reqs, config.scheduler.max_num_queued_tokens)
    clients = []
    for index in range(num_clients):
        client_config = ClientConfig.for_engine(config, info, addresses, index)
        admission = AdmissionControl(limits, shared, index)
        client = AsyncEngineClient(client_config, AsyncTokenizer(tokenizer or ByteTokenizer()), admission)
        client.start()
        clients.append(client)
    try:
        yield Served(clients, proc, thread, errors)
    finally:
        proc.input_queue.put(ShutdownEngine())  # as the launcher does it: the front ends still listen
        thread.join(timeout=10)
        for client in clients:
            await client.shutdown()
        proc.close_io()
        shutil.rmtree(directory, ignore_errors=True)
