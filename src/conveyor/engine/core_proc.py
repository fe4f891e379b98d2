"""The engine-core process: the step loop, with socket I/O on two threads so it never waits on a front end.

Model (vLLM V1's EngineCoreProc): three threads. The input thread receives from the one PULL socket
every front end pushes to, decodes (msgspec) and puts the message on `input_queue`. The main thread
is the busy loop: apply every queued input (add / abort / hello / shutdown), then run one
`EngineCore.step()` and put one `EngineStepOutputs` per front end with news on `output_queue`. The
output thread encodes and sends each on that front end's own PUSH socket. So the loop touches no
socket and no serialization: a slow or gone front end only fills a queue.

Blocking: with nothing to do the loop blocks on `input_queue` (no spin); while requests wait but
nothing could be scheduled it wakes every `IDLE_POLL_S` so queue timeouts still fire. After an
abort it runs one step even if nothing is left, so the worker drops the request's state and the
front end receives fresh stats (running and KV usage back to 0).

The engine's state goes to exactly one front end, client 0 (`scheduler_stats` on its message every
step), so counters summed across front ends are not counted N times. If the loop raises, every front
end gets `EngineDead` and the process exits 1; SIGINT/SIGTERM are ignored (the launcher drains the
front ends first, then sends `ShutdownEngine`), and the death of the launching process ends it too.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import queue
import threading
import time
from collections import defaultdict
from dataclasses import dataclass

import zmq

from conveyor.core.errors import AdmissionError, QueueFullError
from conveyor.core.lifecycle import with_eos_stop_ids
from conveyor.core.outputs import EngineCoreOutput, EngineCoreOutputs
from conveyor.engine.engine_core import EngineCore, StepResult
from conveyor.engine.messages import (
    AbortRequests,
    AddRequest,
    ClientHello,
    DrainStepLog,
    EngineDead,
    EngineInput,
    EngineOutput,
    EngineStepOutputs,
    CheckHealth,
    HealthReply,
    PrefixCacheReset,
    ResetPrefixCache,
    ShutdownEngine,
    StepLogRecords,
    encoder,
    input_decoder,
)
from conveyor.request import FinishReason, Request

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.05
"""How often the loop wakes while requests wait but nothing could be scheduled (queue timeouts)."""
STATS_CLIENT = 0
"""The front end that receives the engine's SchedulerStats."""
SOCKET_LINGER_MS = 2000
"""How long closing a socket may wait to deliver what is queued (the last outputs, EngineDead)."""
PEER_WAIT_S = 2.0
"""How long a message waits for its front end's connection before it is dropped."""
PEER_RETRY_S = 0.01


@dataclass(frozen=True)
class EngineAddresses:
    """The ZeroMQ endpoints of one engine core (ipc:// paths made by the launcher)."""

    input: str
    """PULL, bound by the core; every front end PUSHes its inputs here."""
    outputs: tuple[str, ...]
    """PUSH, bound by the core; front end i PULLs from outputs[i]."""
    handshake: str
    """PULL, bound by the launcher; the core PUSHes EngineReady or EngineStartupFailed once."""


@dataclass(frozen=True)
class CoreFailure:
    """Queued by `EngineCoreProc.fail` (never sent over a socket): the loop raises on it."""

    reason: str


class EngineCoreProc:
    """Owns an `EngineCore` in its own process and serves the front ends' sockets."""

    def __init__(self, core: EngineCore, addresses: EngineAddresses, context: zmq.Context) -> None:
        self._core = core
        self._addresses = addresses
        self._context = context
        self._eos = core.limits.eos
        self._peak_memory = _peak_memory_probe(core.config.device.device)
        self.input_queue: queue.Queue[EngineInput | CoreFailure] = queue.Queue()
        self._output_queue: queue.Queue[tuple[int, EngineOutput] | None] = queue.Queue()
        self._client_of: dict[str, int] = {}
        self._connected: set[int] = set()
        self._pending_finished: list[EngineCoreOutput] = []  # aborts, sent with the next step
        self._dirty = False  # state changed outside a step: step once more
        self._idle = False  # the last step scheduled nothing
        self._stopping = False
        self._threads: list[threading.Thread] = []

    def start_io_threads(self) -> None:
        """Bind the sockets (each on its own thread) and return once both are bound."""
        for target in (self._input_thread, self._output_thread):
            bound = threading.Event()
            thread = threading.Thread(target=target, args=(bound,), name=f"engine-{target.__name__[1:]}",
                                      daemon=True)
            thread.start()
            if not bound.wait(timeout=30):
                raise RuntimeError(f"{thread.name} could not bind its socket")
            self._threads.append(thread)

    def run(self) -> None:
        """The busy loop, until ShutdownEngine (then live requests are aborted and reported)."""
        try:
            while not self._stopping:
                for message in self._next_inputs():
                    self._apply(message)
                if not self._stopping and (self._dirty or self._core.has_unfinished_requests()):
                    self._step()
        except BaseException as error:
            logger.exception("engine core loop failed")
            self._broadcast(EngineDead(f"the engine core failed: {type(error).__name__}: {error}"))
            self._close_output()
            raise
        self._abort_all()
        self._close_output()

    # ---- the loop ---------------------------------------------------------------------------------

    def fail(self, reason: str) -> None:
        """From another thread (a dead tensor-parallel rank): the loop stops with EngineDead to every front
        end, even while it is idle."""
        self.input_queue.put(CoreFailure(reason))

    def _next_inputs(self) -> list[EngineInput | CoreFailure]:
        messages: list[EngineInput | CoreFailure] = []
        if not (self._dirty or self._core.has_unfinished_requests()):
            messages.append(self.input_queue.get())  # nothing to do: sleep until a front end speaks
        elif self._idle:
            try:
                messages.append(self.input_queue.get(timeout=IDLE_POLL_S))
            except queue.Empty:
                pass
        while True:
            try:
                messages.append(self.input_queue.get_nowait())
            except queue.Empty:
                return messages

    def _apply(self, message: EngineInput | CoreFailure) -> None:
        if isinstance(message, CoreFailure):
            raise RuntimeError(message.reason)
        if isinstance(message, AddRequest):
            self._add(message)
        elif isinstance(message, AbortRequests):
            live = [rid for rid in message.request_ids if rid in self._client_of]
            self._pending_finished.extend(self._core.abort(live, message.reason))
            self._dirty = True
        elif isinstance(message, ClientHello):
            self._connected.add(message.client_index)
        elif isinstance(message, ShutdownEngine):
            self._stopping = True
        elif isinstance(message, CheckHealth):
            self._output_queue.put((message.client_index, HealthReply(message.token)))
        elif isinstance(message, ResetPrefixCache):
            reset = self._core.reset_prefix_cache(message.reset_running_requests)
            self._dirty = self._dirty or message.reset_running_requests  # a step tells the worker of its victims
            self._output_queue.put((message.client_index, PrefixCacheReset(message.token, reset)))
        elif isinstance(message, DrainStepLog):
            records = self._core.drain_step_log()
            answer = StepLogRecords(message.token, records is not None, records or [])
            self._output_queue.put((message.client_index, answer))

    def _add(self, message: AddRequest) -> None:
        params = with_eos_stop_ids(message.sampling_params, self._eos)
        request = Request(message.request_id, message.prompt_token_ids, params,
                          message.arrival_s, eos_token_id=self._eos.primary, priority=message.priority,
                          cache_salt=message.cache_salt)
        self._client_of[message.request_id] = message.client_index
        self._connected.add(message.client_index)
        try:
            self._core.add_request(request)
        except (AdmissionError, QueueFullError, ValueError) as error:
            # The front end admitted it by the same rule, so this is a bug (or a duplicate id across
            # front ends): fail this request, not the engine.
            logger.error("request %s refused by the scheduler after admission: %s", message.request_id, error)
            self._pending_finished.append(EngineCoreOutput(message.request_id, [], finish_reason=FinishReason.ERROR))
        self._dirty = True

    def _step(self) -> None:
        result = self._core.step()
        self._dirty = False
        self._idle = result.stats.num_scheduled_tokens == 0
        self._send_step(result)

    def _send_step(self, result: StepResult) -> None:
        """One message per front end with news; the stats ride on client 0's (sent even if empty)."""
        finished = self._pending_finished + result.outputs.finished_outputs
        self._pending_finished = []
        by_client = self._split(result.outputs, finished)
        if STATS_CLIENT in self._connected:
            message = by_client.setdefault(STATS_CLIENT, EngineStepOutputs(req_ids=[], new_token_ids=[]))
            message.scheduler_stats = result.stats
            message.peak_memory_bytes = self._peak_memory()
        for client_index, message in by_client.items():
            self._output_queue.put((client_index, message))
        for output in finished:
            self._client_of.pop(output.request_id, None)

    def _split(self, outputs: EngineCoreOutputs, finished: list[EngineCoreOutput]) -> dict[int, EngineStepOutputs]:
        if len(self._addresses.outputs) == 1:  # one front end: the scheduler's lists go as they are
            if not outputs.req_ids and not finished:
                return {}
            return {0: EngineStepOutputs(outputs.req_ids, outputs.new_token_ids, outputs.new_logprobs, finished)}
        by_client: dict[int, EngineStepOutputs] = defaultdict(lambda: EngineStepOutputs([], [], {}, []))
        client_of = self._client_of
        for request_id, token_ids in zip(outputs.req_ids, outputs.new_token_ids):
            message = by_client[client_of[request_id]]
            message.req_ids.append(request_id)
            message.new_token_ids.append(token_ids)
            if request_id in outputs.new_logprobs:
                message.new_logprobs[request_id] = outputs.new_logprobs[request_id]
        for output in finished:
            by_client[client_of.get(output.request_id, STATS_CLIENT)].finished.append(output)
        return dict(by_client)

    def _abort_all(self) -> None:
        """Clean stop: every live request ends as ABORT and its front end is told."""
        live = list(self._client_of)
        if live:
            self._pending_finished.extend(self._core.abort(live, FinishReason.ABORT))
            self._step()

    def close_io(self) -> None:
        """After `run` returned: stop both I/O threads (the output thread stopped with the loop)."""
        self._close_output()
        self._context.term()

    def _broadcast(self, message: EngineOutput) -> None:
        for client_index in range(len(self._addresses.outputs)):
            self._output_queue.put((client_index, message))

    def _close_output(self) -> None:
        """Let the output thread send what is queued, then stop it."""
        self._output_queue.put(None)
        for thread in self._threads:
            if thread.name == "engine-output_thread":
                thread.join(timeout=SOCKET_LINGER_MS / 1000)

    # ---- I/O threads ------------------------------------------------------------------------------

    def _input_thread(self, bound: threading.Event) -> None:
        decoder = input_decoder()
        socket = self._context.socket(zmq.PULL)
        socket.setsockopt(zmq.RCVHWM, 0)
        socket.bind(self._addresses.input)
        bound.set()
        try:
            while True:
                frame = socket.recv(copy=False)
                self.input_queue.put(decoder.decode(frame.buffer))
        except zmq.ContextTerminated:  # close_io(): the only way to wake a thread blocked in recv
            socket.close(linger=0)

    def _output_thread(self, bound: threading.Event) -> None:
        encode = encoder().encode
        sockets = []
        for address in self._addresses.outputs:
            socket = self._context.socket(zmq.PUSH)
            socket.setsockopt(zmq.SNDHWM, 0)
            socket.setsockopt(zmq.LINGER, SOCKET_LINGER_MS)
            socket.bind(address)
            sockets.append(socket)
        bound.set()
        gone: set[int] = set()
        try:
            while (item := self._output_queue.get()) is not None:
                client_index, message = item
                if not _send_or_drop(sockets[client_index], encode(message), client_index in gone):
                    gone.add(client_index)
                else:
                    gone.discard(client_index)
        except zmq.ContextTerminated:
            pass
        for socket in sockets:
            socket.close()


def _send_or_drop(socket: zmq.Socket, payload: bytes, known_gone: bool) -> bool:
    """Send without ever blocking the output thread for good. A PUSH socket refuses (EAGAIN) only while
    no front end is connected to it: right after start (the connection is still being made: retry for
    up to `PEER_WAIT_S`) or after that front end went away (drop its messages, at once once known)."""
    attempts = 1 if known_gone else int(PEER_WAIT_S / PEER_RETRY_S)
    for _ in range(attempts):
        try:
            socket.send(payload, zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            time.sleep(PEER_RETRY_S)
    logger.warning("a front end is not connected; dropped one engine output message")
    return False


def watch_parent(input_queue: queue.Queue[EngineInput | CoreFailure]) -> None:
    """When the launching process dies (even by SIGKILL) the engine shuts itself down."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def wait() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        logger.warning("the launching process died; shutting the engine core down")
        input_queue.put(ShutdownEngine())

    threading.Thread(target=wait, name="engine-parent-watch", daemon=True).start()


def _peak_memory_probe(device: str):  # noqa: ANN202 - returns a zero-argument callable
    """This process's peak device memory in bytes: torch.cuda.max_memory_reserved on CUDA; on CPU the
    peak resident set size (ru_maxrss: KiB on Linux, bytes on macOS), where weights and KV cache live."""
    if device != "cuda":
        import resource
        import sys

        scale = 1 if sys.platform == "darwin" else 1024
        return lambda: int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * scale
    import torch  # the engine process has loaded it already

    return lambda: int(torch.cuda.max_memory_reserved())
