"""The asyncio façade over `LLMEngine`: the step loop runs in its own thread beside the event loop.

Threads and ownership: the engine thread alone touches the `LLMEngine` (scheduler, runner, output
processor). The event loop talks to it through a thread-safe command queue (add / abort / stop),
drained at the start of every step, and receives outputs through each request's own `asyncio.Queue`,
filled with `loop.call_soon_threadsafe`. When no request is live the thread blocks on the command
queue (no busy spin); while requests wait but nothing could be scheduled it wakes every
`IDLE_POLL_S` so queue timeouts still fire. `generate` validates and submits synchronously, so a bad
or excess request raises before the caller sees any output. If the engine thread crashes, every live
request gets a final ERROR output and later calls raise `EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import PurePath

from conveyor.config import EngineConfig
from conveyor.engine.args import engine_config_to_flags
from conveyor.engine.engine_loop import Command, CommandKind, EngineLoop, error_output
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.types import (
    EngineDeadError,
    EngineInfo,
    EngineOverloadedError,
    GenerateRequest,
    RequestOutput,
    RequestRejectedError,
    StatsListener,
)

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    """The event-loop side of one request."""

    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue[RequestOutput | BaseException]


class AsyncEngine:
    """Implements `engine.types.EngineClient` over an `LLMEngine` running on a dedicated thread."""

    def __init__(self, engine: LLMEngine, info: EngineInfo) -> None:
        self._engine = engine
        self._info = info
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # guards _streams (read by the engine thread to deliver)
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._loop = EngineLoop(engine, self._commands, self._deliver)
        self._thread = threading.Thread(target=self._loop.run, name="conveyor-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        """Load the model and start the engine thread (blocking: seconds to minutes)."""
        engine = LLMEngine.from_config(config)
        return cls(engine, build_engine_info(engine))

    @property
    def info(self) -> EngineInfo:
        return self._info

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._engine.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def detokenize(self, token_ids: list[int]) -> str:
        return self._engine.tokenizer.decode(token_ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        template = getattr(self._engine.tokenizer, "apply_chat_template")
        return template(messages, add_generation_prompt=add_generation_prompt)

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Validate and submit now (raising RequestRejectedError / EngineOverloadedError /
        EngineDeadError), then stream. Closing the iterator before the end aborts the request."""
        self._raise_if_dead()
        prepared = self._engine.prepare(request)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if request.request_id in self._streams:
                raise RequestRejectedError("request_id", f"request id {request.request_id!r} is already in use")
            self._check_queue_room()
            self._streams[request.request_id] = stream
            self._loop.note_submitted()
        self._commands.put(Command(CommandKind.ADD, prepared=prepared))
        if not self._thread.is_alive():  # died between the check and the put: nobody will answer
            stream.outputs.put_nowait(error_output(request.request_id, "the engine stopped"))
        return _RequestStream(self._stream(request.request_id, stream),
                              lambda: self._forget(request.request_id))

    def _forget(self, request_id: str) -> None:
        """The consumer left before reading anything: drop its stream and free its blocks."""
        with self._lock:
            self._streams.pop(request_id, None)
        self._commands.put(Command(CommandKind.ABORT, request_ids=[request_id]))

    async def _stream(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await stream.outputs.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:  # consumer went away (aclose / cancellation): free the blocks
                self._commands.put(Command(CommandKind.ABORT, request_ids=[request_id]))

    async def abort(self, request_id: str) -> None:
        """End a request; its stream receives a final ABORT output."""
        self._commands.put(Command(CommandKind.ABORT, request_ids=[request_id]))

    def add_stats_listener(self, listener: StatsListener) -> None:
        self._loop.add_stats_listener(listener)

    def num_unfinished_requests(self) -> int:
        with self._lock:
            return len(self._streams)

    async def shutdown(self) -> None:
        """Stop the engine thread (live requests end with ABORT) and wait for it."""
        if self._thread.is_alive():
            self._commands.put(Command(CommandKind.STOP))
            await asyncio.to_thread(self._thread.join)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._loop.error is None

    def _raise_if_dead(self) -> None:
        if self._loop.error is not None:
            raise EngineDeadError(f"the engine loop crashed: {self._loop.error!r}")
        if not self._thread.is_alive() or self._loop.stopping:
            raise EngineDeadError("the engine has been shut down")

    def _check_queue_room(self) -> None:
        """Reject when the waiting requests (admitted or still in the command queue) fill the bound."""
        bound = self._engine.config.scheduler.max_num_queued_reqs
        if bound is not None and self._loop.num_waiting_estimate() >= bound:
            raise EngineOverloadedError(
                f"the waiting queue is full ({bound} requests, --max-num-queued-reqs); retry later")

    def _deliver(self, outputs: list[RequestOutput | tuple[str, BaseException]]) -> None:
        """Engine thread: hand each output to its request's event loop."""
        with self._lock:
            for item in outputs:
                request_id, payload = (item.request_id, item) if isinstance(item, RequestOutput) else item
                stream = self._streams.get(request_id)
                if stream is None:
                    continue  # the consumer already left (its abort is queued)
                try:
                    stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, payload)
                except RuntimeError:  # its event loop has closed: nobody is listening, free the request
                    self._streams.pop(request_id, None)
                    self._commands.put(Command(CommandKind.ABORT, request_ids=[request_id]))


class _RequestStream:
    """The iterator `generate` returns. An async generator closed before its first `__anext__` never
    runs its `finally`, so a client that leaves at that exact moment would leave its stream registered;
    this wrapper runs `on_unstarted_close` in that case."""

    def __init__(self, outputs: AsyncGenerator[RequestOutput, None], on_unstarted_close: Callable[[], None]) -> None:
        self._outputs = outputs
        self._on_unstarted_close = on_unstarted_close
        self._started = False

    def __aiter__(self) -> _RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        self._started = True
        return await self._outputs.__anext__()

    async def aclose(self) -> None:
        if not self._started:
            self._started = True
            self._on_unstarted_close()
        await self._outputs.aclose()


DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
"""Name of the embedded model (used when neither --served-model-name nor --model is given)."""


def model_name_of(config: EngineConfig) -> str:
    """--served-model-name, else the model file's stem or directory's name."""
    if config.model.served_model_name:
        return config.model.served_model_name
    if config.model.model is None:
        return DEFAULT_MODEL_NAME
    path = PurePath(config.model.model.rstrip("/\\"))
    return path.stem if path.suffix.lower() == ".gguf" else path.name


def build_engine_info(engine: LLMEngine) -> EngineInfo:
    """What start-up resolved; max_model_len is the configured one capped by the model's positions."""
    limits = engine.core.limits
    flags = engine_config_to_flags(engine.config)
    flags["max-model-len"] = str(limits.max_model_len)
    return EngineInfo(model_name=model_name_of(engine.config), max_model_len=limits.max_model_len,
                      block_size=engine.config.cache.block_size, num_kv_blocks=limits.num_kv_blocks,
                      config=flags)
