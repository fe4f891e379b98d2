"""One request's trip through the engine, with the cleanup that must happen however it ends.

The invariant: every admitted request is either finished by the engine or aborted in it, and its
in-flight slot is released exactly once, whether the client read everything, went away mid-stream,
went away before the first token, or the server is shutting down. `EngineStream.close` does all of
it and is idempotent; the streaming response calls it from `__call__`'s `finally`, so it runs even if
the body iterator never started.

No status line before the first output: `engine.generate` takes the admission decision (400 / 503
raised at once), and the response waits for the request's first output before sending headers. If
that first output is already the end of a failed request (a queue timeout: the request was never
scheduled; an engine error), the client gets a real 503 / 500, also for `stream: true`. Only
failures after the first output can be an error event inside a 200 stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
from starlette.requests import Request
from pydantic import BaseModel
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from conveyor.engine.types import (
    EngineClient,
    EngineDeadError,
    EngineError,
    EngineOverloadedError,
    GenerateRequest,
    RequestOutput,
    RequestRejectedError,
)
from conveyor.request import FinishReason
from conveyor.server.errors import APIError, ErrorType, RejectReason
from conveyor.server.lifecycle import AdmissionGate, InFlightSlot
from conveyor.server.responses import SSE_DONE

T = TypeVar("T")
RETRY_AFTER_S = 1
"""Seconds a client told `Retry-After` should wait (the queue drains at engine-step speed)."""


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


def engine_dead_error() -> APIError:
    return APIError(503, "the engine has stopped; this server can no longer generate",
                    ErrorType.OVERLOADED, reason=RejectReason.ENGINE_DEAD)


def _admission_error(error: EngineError, prompt_param: str) -> APIError:
    if isinstance(error, RequestRejectedError):
        param = prompt_param if error.field == "prompt" else error.field
        message = str(error) if param == error.field else str(error).replace("prompt", param, 1)
        return APIError(400, message, param=param, reason=RejectReason.ENGINE_REJECTED)
    if isinstance(error, EngineOverloadedError):
        return APIError(503, f"the server is overloaded: {error}", ErrorType.OVERLOADED,
                        reason=RejectReason(error.reason.value), headers={"Retry-After": str(RETRY_AFTER_S)})
    return engine_dead_error()


def failed_output_error(output: RequestOutput) -> APIError | None:
    """The error a finished output carries (queue timeout: 503; a grammar the output could not follow: 400
    naming its field; engine failure: 500), if any."""
    if output.finish_reason is FinishReason.QUEUE_TIMEOUT:
        message = output.error_message or "the request waited too long in the queue"
        return APIError(503, message, ErrorType.TIMEOUT, reason=None,
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if output.finish_reason is FinishReason.ERROR and output.error_param is not None:  # the request's grammar
        return APIError(400, output.error_message or "the output cannot follow the grammar",
                        param=output.error_param, reason=None)
    if output.finish_reason is FinishReason.ERROR:
        return APIError(500, output.error_message or "the engine failed while generating",
                        ErrorType.INTERNAL, reason=None)
    return None


class EngineStream:
    """The engine's outputs for one request, with idempotent cleanup (abort + slot release)."""

    def __init__(self, engine: EngineClient, request: GenerateRequest, gate: AdmissionGate,
                 prompt_param: str = "prompt") -> None:
        self._engine = engine
        self._gate = gate
        self._prompt_param = prompt_param
        """The request field a rejected prompt is reported under (`messages` for chat)."""
        self.request_id = request.request_id
        self._slot: InFlightSlot = gate.admit(request.request_id)
        self._finished = False
        self._closed = False
        try:
            self._outputs = engine.generate(request)
        except BaseException as error:
            self._finished = True
            self._slot.release()
            if isinstance(error, EngineError):
                raise self._mapped(error) from None
            raise

    def _mapped(self, error: EngineError) -> APIError:
        if isinstance(error, EngineDeadError):
            self._gate.engine_dead = True
        return _admission_error(error, self._prompt_param)

    async def next(self) -> RequestOutput:
        """The next output; engine errors become APIError. Call only while not finished."""
        try:
            output = await self._outputs.__anext__()
        except StopAsyncIteration:
            self._finished = True
            raise APIError(500, "the engine ended the request without a final output",
                           ErrorType.INTERNAL, reason=None) from None
        except EngineError as error:
            self._finished = True
            raise self._mapped(error) from None
        self._finished = output.finished
        return output

    async def rest(self, first: RequestOutput) -> AsyncIterator[RequestOutput]:
        """`first`, then every later output up to and including the final one."""
        output = first
        yield output
        while not output.finished:
            output = await self.next()
            yield output

    async def close(self) -> None:
        """Abort in the engine if unfinished, close the iterator, release the slot. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            with anyio.CancelScope(shield=True):  # runs even while the response task is cancelled
                if isinstance(self._outputs, AsyncGenerator):
                    await self._outputs.aclose()
                if not self._finished:
                    await self._engine.abort(self.request_id)
        except EngineError:
            pass  # a dead engine has nothing left to abort
        finally:
            self._slot.release()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def run_unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Run `work`; if the client disconnects first, cancel it and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


class EngineStreamResponse(StreamingResponse):
    """An SSE response whose engine request is closed when the response ends, however it ends."""

    def __init__(self, body: AsyncGenerator[str, None], on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._body = body
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._body.aclose()
                await self._on_close()


@dataclass(frozen=True)
class ResponseRenderer:
    """How one endpoint turns its engine streams (one per choice, with their first outputs) into HTTP bodies."""

    chunks: Callable[[list[EngineStream], list[RequestOutput]], AsyncGenerator[str, None]]
    """SSE events for a streaming response."""
    collect: Callable[[list[EngineStream], list[RequestOutput]], Awaitable[BaseModel]]
    """The whole response object for a non-streaming one."""


def fan_out(request: GenerateRequest, n: int) -> list[GenerateRequest]:
    """`n` choices = n engine requests `<id>-<i>` (vLLM's parallel sampling: a seeded request's child i
    samples with seed + i); n = 1 is the request itself."""
    if n == 1:
        return [request]
    children = []
    for index in range(n):
        params = request.sampling_params
        if params.seed is not None:
            params = dataclasses.replace(params, seed=params.seed + index)
        children.append(dataclasses.replace(request, request_id=f"{request.request_id}-{index}", sampling_params=params))
    return children


def open_streams(engine: EngineClient, requests: list[GenerateRequest], gate: AdmissionGate,
                 prompt_param: str = "prompt") -> list[EngineStream]:
    """Admit every choice's request, or none: a refusal of one aborts those already admitted."""
    streams: list[EngineStream] = []
    try:
        for request in requests:
            streams.append(EngineStream(engine, request, gate, prompt_param))
    except BaseException:
        for stream in streams:
            asyncio.ensure_future(stream.close())
        raise
    return streams


async def merged(streams: list[EngineStream], firsts: list[RequestOutput]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) of every stream as they arrive, each stream's in order, until all ended."""
    if len(streams) == 1:
        async for output in streams[0].rest(firsts[0]):
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

    async def pump(index: int) -> None:
        try:
            async for output in streams[index].rest(firsts[index]):
                queue.put_nowait((index, output))
        except BaseException as error:  # noqa: BLE001 - handed to the consumer, which re-raises it
            queue.put_nowait(error)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.ensure_future(pump(index)) for index in range(len(streams))]
    try:
        for _ in range(len(streams)):
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
    finally:
        for task in tasks:
            task.cancel()


async def respond(streams: list[EngineStream], http_request: Request, streaming: bool,
                  renderer: ResponseRenderer) -> Response:
    """The flow both generation endpoints share: wait for every choice's first output (so admission
    errors are real 4xx/5xx, not events in a 200 stream), then stream or collect; every engine request
    is closed however the response ends."""
    async def close_all() -> None:
        for stream in streams:
            await stream.close()

    try:
        firsts = [await run_unless_disconnected(http_request, stream.next()) for stream in streams]
        for first in firsts:
            failed = failed_output_error(first)
            if failed is not None:  # ended before it ever ran (queue timeout): a real status, no 200
                raise failed
        if streaming:
            return EngineStreamResponse(renderer.chunks(streams, firsts), on_close=close_all)
        final = await run_unless_disconnected(http_request, renderer.collect(streams, firsts))
    except BaseException:
        await close_all()
        raise
    await close_all()
    return Response(final.model_dump_json(), media_type="application/json")


async def drain(stream: EngineStream, first: RequestOutput) -> list[RequestOutput]:
    """Every output of a non-streaming request, first included; raises the API error of a failed end."""
    outputs = [output async for output in stream.rest(first)]
    error = failed_output_error(outputs[-1])
    if error is not None:
        raise error
    return outputs


async def drain_all(streams: list[EngineStream], firsts: list[RequestOutput]) -> list[list[RequestOutput]]:
    """`drain` of every choice, in choice order: what a non-streaming response is built from."""
    return [await drain(stream, first) for stream, first in zip(streams, firsts)]


ChoiceEvent = Callable[[int, RequestOutput, list[RequestOutput]], str]
"""(choice index, its new output, every choice's latest output) -> the SSE event for that output."""


async def sse_events(streams: list[EngineStream], firsts: list[RequestOutput], prelude: list[str],
                     event: ChoiceEvent, closing: Callable[[list[RequestOutput]], str] | None
                     ) -> AsyncGenerator[str, None]:
    """The SSE body both generation endpoints share: `prelude` (the chat role deltas, the echoed prompt),
    then one event per output that carries something new -- a token whose text the detokenizer holds back
    still gets its event, as in vLLM -- then `closing(lasts)` (the usage chunk, when asked for) and
    `[DONE]`. A failed end or an API error mid-stream is the last event instead, with no `[DONE]`."""
    for text in prelude:
        yield text
    lasts = list(firsts)
    try:
        async for index, output in merged(streams, firsts):
            lasts[index] = output
            error = failed_output_error(output)
            if error is not None:
                yield error.to_sse()
                return
            if output.new_token_ids or output.new_text or output.finished or output.new_logprobs:
                yield event(index, output, lasts)
    except APIError as error:
        yield error.to_sse()
        return
    if closing is not None:
        yield closing(lasts)
    yield SSE_DONE
