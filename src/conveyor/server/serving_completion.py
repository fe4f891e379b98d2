"""POST /v1/completions: prompt (text or token ids) -> engine -> one response or an SSE stream."""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from conveyor.engine.types import GenerateRequest, RequestOutput
from conveyor.server.context import ServingContext, finish_reason_text
from conveyor.server.errors import APIError
from conveyor.server.generation import (
    EngineStream,
    ResponseRenderer,
    drain,
    failed_output_error,
    respond,
)
from conveyor.server.protocol import CompletionRequest
from conveyor.server.responses import (
    SSE_DONE,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    UsageInfo,
    sse,
)


@dataclass(frozen=True)
class PreparedCompletion:
    """A validated completion request, tokenized, ready for the engine."""

    request: GenerateRequest
    created: int
    echo_text: str | None
    """The prompt text to prepend (echo), else None."""
    include_usage: bool
    want_logprobs: bool


async def prepare_completion(ctx: ServingContext, body: CompletionRequest) -> PreparedCompletion:
    """Validate the body and tokenize the prompt (off the event loop); the engine admits it."""
    arrival_s = time.monotonic()
    body.check_supported()
    prompt = body.single_prompt()
    params = body.to_sampling_params(body.max_tokens, body.logprobs)
    if isinstance(prompt, str):
        token_ids = await ctx.engine.tokenize(prompt, add_special_tokens=True)
        ctx.metrics.observe_tokenization(time.monotonic() - arrival_s)
    else:
        token_ids = prompt
    echo_text = None
    if body.echo:
        echo_text = prompt if isinstance(prompt, str) else await ctx.engine.detokenize(token_ids)
    request = GenerateRequest(request_id=f"cmpl-{uuid.uuid4().hex}", prompt_token_ids=token_ids,
                              sampling_params=params, priority=body.priority, cache_salt=body.cache_salt,
                              arrival_s=arrival_s)
    return PreparedCompletion(request=request, created=int(time.time()), echo_text=echo_text,
                              include_usage=body.include_usage_in_stream, want_logprobs=body.logprobs is not None)


async def create_completion(ctx: ServingContext, body: CompletionRequest, http_request: Request) -> Response:
    prepared = await prepare_completion(ctx, body)
    renderer = ResponseRenderer(chunks=functools.partial(_chunks, ctx, prepared),
                                collect=functools.partial(_collect, ctx, prepared))
    stream = EngineStream(ctx.engine, prepared.request, ctx.gate)
    return await respond(stream, http_request, body.stream, renderer)


async def _collect(ctx: ServingContext, prepared: PreparedCompletion, stream: EngineStream,
                   first: RequestOutput) -> CompletionResponse:
    outputs = await drain(stream, first)
    last = outputs[-1]
    texts = [prepared.echo_text] if prepared.echo_text is not None else []
    texts.extend(output.new_text for output in outputs)
    logprobs = CompletionLogprobs() if prepared.want_logprobs else None
    offset = 0
    for output in outputs:
        if logprobs is not None:
            offset = logprobs.extend(output.new_logprobs, offset)
    choice = CompletionChoice(text="".join(texts), logprobs=logprobs,
                              finish_reason=finish_reason_text(last), stop_reason=last.stop_reason)
    return CompletionResponse(id=prepared.request.request_id, created=prepared.created,
                              model=ctx.model_name, choices=[choice],
                              usage=UsageInfo.of(last.num_prompt_tokens, last.num_output_tokens))


def _chunk(ctx: ServingContext, prepared: PreparedCompletion, choices: list[CompletionChoice],
           usage: UsageInfo | None = None) -> str:
    return sse(CompletionResponse(id=prepared.request.request_id, created=prepared.created,
                                  model=ctx.model_name, choices=choices, usage=usage))


async def _chunks(ctx: ServingContext, prepared: PreparedCompletion, stream: EngineStream,
                  first: RequestOutput) -> AsyncGenerator[str, None]:
    if prepared.echo_text:
        yield _chunk(ctx, prepared, [CompletionChoice(text=prepared.echo_text)])
    offset = 0
    last = first
    try:
        async for output in stream.rest(first):
            last = output
            error = failed_output_error(output)
            if error is not None:
                yield error.to_sse()
                return
            if not (output.new_token_ids or output.new_text or output.finished or output.new_logprobs):
                continue  # nothing new (a token whose text is held back still gets its chunk, as in vLLM)
            logprobs = None
            if prepared.want_logprobs:
                logprobs = CompletionLogprobs()
                offset = logprobs.extend(output.new_logprobs, offset)
            choice = CompletionChoice(text=output.new_text, logprobs=logprobs,
                                      finish_reason=finish_reason_text(output), stop_reason=output.stop_reason)
            yield _chunk(ctx, prepared, [choice])
    except APIError as error:
        yield error.to_sse()
        return
    if prepared.include_usage:
        yield _chunk(ctx, prepared, [], UsageInfo.of(last.num_prompt_tokens, last.num_output_tokens))
    yield SSE_DONE
