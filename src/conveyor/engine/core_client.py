"""The API-process half of the engine: admission, the sockets to the engine core, and output processing.

Model (vLLM V1's AsyncLLM + AsyncMPClient): `generate` takes the one admission decision
(`engine.admission`), registers the request with the `OutputProcessor` and a per-request
`asyncio.Queue`, and pushes an `AddRequest` to the core: it never waits for the core. A request with a
grammar first waits for it to compile in `GrammarChecker`'s workers (vLLM's WAITING_FOR_FSM, here in the
front end): it is admitted and counted meanwhile, others are not delayed, and a grammar that fails ends
its stream with the 400 before the core ever sees it. One task, the
output handler, receives each step's `EngineStepOutputs`, detokenizes and checks stop strings
(`OutputProcessor`, here in the API process), sends an abort to the core for a matched stop string,
and puts every `RequestOutput` on its request's queue. Everything runs on the event loop except
tokenization (`AsyncTokenizer`'s worker threads) and grammar compiles (`GrammarChecker`'s processes).

Engine death: the core sends `EngineDead` when its loop fails; when it is killed outright, the
lifeline pipe (whose only writer is the engine process) reads EOF. Either way every live request's
queue gets `EngineDeadError`, later calls raise it, and the dead listeners run (the server exits
non-zero).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing.connection
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable

import zmq
import zmq.asyncio

from conveyor.config import EngineConfig
from conveyor.core.outputs import EngineCoreOutputs
from conveyor.core.step_log import StepRecord
from conveyor.engine.admission import AdmissionControl, QueueLimits, SharedCounts, check_request
from conveyor.engine.async_tokenizer import AsyncTokenizer
from conveyor.engine.client_config import ClientConfig
from conveyor.engine.grammar_check import GrammarChecker, check_size, with_constraint
from conveyor.engine.messages import (
    AbortRequests,
    AddRequest,
    CheckHealth,
    ClientHello,
    DrainStepLog,
    EngineDead,
    EngineInput,
    EngineStepOutputs,
    HealthReply,
    PrefixCacheReset,
    ResetPrefixCache,
    StepLogRecords,
    encoder,
    output_decoder,
)
from conveyor.engine.output_processor import OutputProcessor
from conveyor.engine.types import (
    EngineDeadError,
    EngineInfo,
    GenerateRequest,
    IterationStats,
    RequestOutput,
    RequestRejectedError,
    StatsListener,
)
from conveyor.request import FinishReason

logger = logging.getLogger(__name__)

CoreAnswer = PrefixCacheReset | StepLogRecords | HealthReply
"""What the core sends back to one call (paired by its token)."""


class AsyncEngineClient:
    """Implements `engine.types.EngineClient` over an engine core in another process."""

    @classmethod
    def connect(cls, config: ClientConfig, engine_config: EngineConfig, shared: SharedCounts | None = None,
                lifeline: multiprocessing.connection.Connection | None = None) -> AsyncEngineClient:
        """Load the tokenizer, connect to the core and start the output handler (on the serving loop)."""
        from conveyor.engine.model_files import tokenizer_path
        from conveyor.engine.tokenizer import Tokenizer

        scheduler = engine_config.scheduler
        admission = AdmissionControl(QueueLimits(scheduler.max_num_queued_reqs, scheduler.max_num_queued_tokens),
                                     shared, config.client_index)
        backend = Tokenizer.from_path(tokenizer_path(engine_config.model))
        if config.chat_template is not None:
            backend = dataclasses.replace(backend, chat_template=config.chat_template)
        tokenizer = AsyncTokenizer(backend)
        client = cls(config, tokenizer, admission, lifeline)
        client.start()
        return client

    def __init__(self, config: ClientConfig, tokenizer: AsyncTokenizer, admission: AdmissionControl,
                 lifeline: multiprocessing.connection.Connection | None = None) -> None:
        self._config = config
        self._tokenizer = tokenizer
        self._admission = admission
        self._lifeline = lifeline
        self._processor = OutputProcessor(tokenizer.tokenizer, config.queue_timeout_s)
        self._grammars = GrammarChecker(config.grammar)
        self._compiling: dict[str, asyncio.Task[None]] = {}
        """Requests admitted and waiting for their grammar: not yet sent to the core."""
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._stats_listeners: list[StatsListener] = []
        self._dead_listeners: list[Callable[[], None]] = []
        self._dead_reason: str | None = None
        self._closed = False
        self._context = zmq.asyncio.Context()
        self._encode = encoder().encode
        # Inputs go on a plain (sync) socket over the same context: a send with HWM 0 never waits,
        # so `generate` submits without awaiting anything.
        self._input = zmq.Context(shadow=self._context.underlying).socket(zmq.PUSH)
        self._output = self._context.socket(zmq.PULL)
        self._output_task: asyncio.Task[None] | None = None
        self._calls: dict[int, asyncio.Future[CoreAnswer]] = {}
        """Pending calls answered by the core (reset_prefix_cache, drain_step_log, check_health), by token."""
        self._tokens = itertools.count(1)

    def start(self) -> None:
        """Connect to the core and start the output handler (call on the event loop that will serve)."""
        for socket, address in ((self._output, self._config.addresses.outputs[self._config.client_index]),
                                (self._input, self._config.addresses.input)):
            socket.setsockopt(zmq.SNDHWM, 0)
            socket.setsockopt(zmq.RCVHWM, 0)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(address)
        self._send(ClientHello(self._config.client_index))
        loop = asyncio.get_running_loop()
        self._output_task = loop.create_task(self._handle_outputs(), name="engine-output-handler")
        if self._lifeline is not None:
            loop.add_reader(self._lifeline.fileno(), self._on_lifeline)

    # ---- EngineClient ------------------------------------------------------------------------------

    @property
    def info(self) -> EngineInfo:
        return self._config.info

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._tokenizer.tokenize(text, add_special_tokens)

    async def detokenize(self, token_ids: list[int]) -> str:
        return await self._tokenizer.detokenize(token_ids)

    async def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        return await self._tokenizer.apply_chat_template(messages, add_generation_prompt)

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Admit (raising before any output), submit, and return the request's output stream."""
        self._raise_if_dead()
        request_id, prompt = request.request_id, request.prompt_token_ids
        constraint = request.sampling_params.structured_output
        check_request(prompt, request.sampling_params, self._config.limits)
        if constraint is not None:
            check_size(constraint, self._config.grammar)
        self._admission.admit(request_id, len(prompt))
        arrival_s = time.monotonic() if request.arrival_s is None else request.arrival_s
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = outputs
        if constraint is None:
            self._submit(request, arrival_s)
        else:
            self._compiling[request_id] = asyncio.ensure_future(self._submit_when_compiled(request, arrival_s))
        return RequestStream(self._stream(request_id, outputs), lambda: self._consumer_gone(request_id))

    def _submit(self, request: GenerateRequest, arrival_s: float) -> None:
        params = request.sampling_params
        self._processor.add_request(request.request_id, request.prompt_token_ids, params, arrival_s)
        self._send(AddRequest(request.request_id, request.prompt_token_ids, params, arrival_s,
                              self._config.client_index, request.priority, request.cache_salt))

    async def _submit_when_compiled(self, request: GenerateRequest, arrival_s: float) -> None:
        """Send the request once its grammar compiled; a failed one ends its stream with the rejection."""
        request_id = request.request_id
        constraint = request.sampling_params.structured_output
        assert constraint is not None
        try:
            request = with_constraint(request, await self._grammars.check(constraint))
        except RequestRejectedError as error:
            outputs = self._streams.pop(request_id, None)
            self._admission.release(request_id)
            if outputs is not None:
                outputs.put_nowait(error)
            return
        finally:
            self._compiling.pop(request_id, None)
        if request_id in self._streams and self._dead_reason is None and not self._closed:
            self._submit(request, arrival_s)

    async def abort(self, request_id: str) -> None:
        """End a request in the core; its stream receives the core's final ABORT output."""
        if self._dead_reason is None and request_id in self._streams:
            self._send(AbortRequests([request_id], FinishReason.ABORT))

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's, in the engine core: False (nothing reset) while requests hold KV blocks, unless
        `reset_running_requests` preempts them first."""
        client = self._config.client_index
        answer = await self._call(lambda token: ResetPrefixCache(client, token, reset_running_requests))
        return isinstance(answer, PrefixCacheReset) and answer.reset

    async def check_health(self, timeout_s: float) -> bool:
        """Whether the core answers within `timeout_s`: it answers between two steps, so a stopped or stuck
        core (its process frozen, a step that never ends) is unhealthy while its process still exists."""
        if self._dead_reason is not None or self._closed:
            return False
        client = self._config.client_index
        try:
            answer = await asyncio.wait_for(self._call(lambda token: CheckHealth(client, token)), timeout_s)
        except (asyncio.TimeoutError, EngineDeadError):
            return False
        return isinstance(answer, HealthReply)

    async def drain_step_log(self) -> list[StepRecord] | None:
        """The engine core's step records since the last drain, oldest first (None: --step-log-size is 0)."""
        answer = await self._call(lambda token: DrainStepLog(self._config.client_index, token))
        return answer.records if isinstance(answer, StepLogRecords) and answer.enabled else None

    async def _call(self, make: Callable[[int], EngineInput]) -> CoreAnswer:
        """Send the message `make(token)` builds and wait for the core's answer carrying that token."""
        self._raise_if_dead()
        token = next(self._tokens)
        self._calls[token] = future = asyncio.get_running_loop().create_future()
        self._send(make(token))
        try:
            return await future
        finally:
            self._calls.pop(token, None)

    def add_stats_listener(self, listener: StatsListener) -> None:
        self._stats_listeners.append(listener)

    def add_dead_listener(self, listener: Callable[[], None]) -> None:
        self._dead_listeners.append(listener)

    def num_unfinished_requests(self) -> int:
        return len(self._streams)

    @property
    def is_running(self) -> bool:
        return self._dead_reason is None and not self._closed

    async def shutdown(self) -> None:
        """Stop listening (the launcher stops the core itself); live streams end with EngineDeadError."""
        if self._closed:
            return
        self._closed = True
        self._stop_watching_lifeline()
        if self._output_task is not None:
            self._output_task.cancel()
        self._fail_everything("the server is shutting down")
        for task in self._compiling.values():
            task.cancel()
        self._grammars.shutdown()
        self._input.close()
        self._output.close()
        self._context.term()
        self._tokenizer.shutdown()

    # ---- streams -----------------------------------------------------------------------------------

    async def _stream(self, request_id: str, outputs: asyncio.Queue[RequestOutput | BaseException]
                      ) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:  # the consumer went away (aclose / cancellation)
                self._consumer_gone(request_id)

    def _consumer_gone(self, request_id: str) -> None:
        """Abort in the core; the processor keeps the request until the core's ABORT (for its stats)."""
        if self._streams.pop(request_id, None) is None:
            return
        self._admission.release(request_id)
        compiling = self._compiling.pop(request_id, None)
        if compiling is not None:  # the core never saw it: nothing to abort there
            compiling.cancel()
            return
        if self._dead_reason is None and not self._closed:
            self._send(AbortRequests([request_id], FinishReason.ABORT))

    # ---- the output handler ------------------------------------------------------------------------

    async def _handle_outputs(self) -> None:
        decode = output_decoder().decode
        try:
            while True:
                frame = await self._output.recv(copy=False)
                message = decode(frame.buffer)
                if isinstance(message, EngineDead):
                    self._on_dead(message.message)
                    return
                if isinstance(message, (PrefixCacheReset, StepLogRecords, HealthReply)):
                    future = self._calls.get(message.token)
                    if future is not None and not future.done():
                        future.set_result(message)
                    continue
                self._process(message)
                await asyncio.sleep(0)  # let the streams run between two steps' worth of outputs
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - a broken message must not leave requests hanging
            logger.exception("output handler failed")
            self._on_dead(f"the front end could not process the engine's outputs: {error!r}")

    def _process(self, message: EngineStepOutputs) -> None:
        core_outputs = EngineCoreOutputs(message.req_ids, message.new_token_ids, message.new_logprobs,
                                         message.finished)
        processed = self._processor.process(core_outputs)
        if processed.stop_string_request_ids:
            self._send(AbortRequests(processed.stop_string_request_ids, FinishReason.STOP))
        admission, streams = self._admission, self._streams
        for output in processed.request_outputs:
            request_id = output.request_id
            admission.prefill_done(request_id)
            outputs = streams.get(request_id)
            if output.finished:
                admission.release(request_id)
                streams.pop(request_id, None)
            if outputs is not None:
                outputs.put_nowait(output)
        for finished in processed.finished_stats:
            admission.release(finished.request_id)
        if message.scheduler_stats is not None or processed.finished_stats:
            stats = IterationStats(message.scheduler_stats, processed.finished_stats, message.peak_memory_bytes)
            for listener in self._stats_listeners:
                listener(stats)

    # ---- engine death ------------------------------------------------------------------------------

    def _on_lifeline(self) -> None:
        self._stop_watching_lifeline()
        if not self._closed:
            self._on_dead("the engine core process died")

    def _stop_watching_lifeline(self) -> None:
        if self._lifeline is not None:
            asyncio.get_running_loop().remove_reader(self._lifeline.fileno())
            self._lifeline = None

    def _on_dead(self, reason: str) -> None:
        if self._dead_reason is not None:
            return
        self._dead_reason = reason
        logger.error("engine core is dead: %s", reason)
        self._fail_everything(reason)
        for listener in self._dead_listeners:
            listener()

    def _fail_everything(self, reason: str) -> None:
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        streams, self._streams = self._streams, {}
        for outputs in streams.values():
            outputs.put_nowait(EngineDeadError(reason))
        self._processor.fail_all(reason)
        self._admission.release_all()

    def _raise_if_dead(self) -> None:
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        if self._closed:
            raise EngineDeadError("the engine client has been shut down")

    def _send(self, message: EngineInput) -> None:
        self._input.send(self._encode(message), copy=False)


class RequestStream:
    """The iterator `generate` returns. An async generator closed before its first `__anext__` never
    runs its `finally`, so a client that leaves at that exact moment would leave its request
    registered; this wrapper runs `on_unstarted_close` in that case."""

    def __init__(self, outputs: AsyncGenerator[RequestOutput, None], on_unstarted_close: Callable[[], None]) -> None:
        self._outputs = outputs
        self._on_unstarted_close = on_unstarted_close
        self._started = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        self._started = True
        return await self._outputs.__anext__()

    async def aclose(self) -> None:
        if not self._started:
            self._started = True
            self._on_unstarted_close()
        await self._outputs.aclose()
