"""POST /v1/completions: prompt (text or token ids) -> engine -> one response or an SSE stream."""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from conveyor.engine.types import GenerateRequest, RequestOutput
from conveyor.server.context import (
    ServingContext,
    check_logprobs,
    engine_request_id,
    finish_reason_text,
    log_request,
    total_usage,
)
from conveyor.server.generation import (
    EngineStream,
    ResponseRenderer,
    drain_all,
    fan_out,
    open_streams,
    respond,
    sse_events,
)
from conveyor.server.protocol import CompletionRequest, effective_max_tokens
from conveyor.server.responses import (
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
    response_id: str
    """The `id` the client sees (`cmpl-<X-Request-Id>` when it sent one)."""
    continuous_usage: bool = False
    """stream_options.continuous_usage_stats: usage on every chunk."""


async def prepare_completion(ctx: ServingContext, body: CompletionRequest, http_request: Request) -> PreparedCompletion:
    """Validate the body and tokenize the prompt (off the event loop); the engine admits it."""
    arrival_s = time.monotonic()
    body.check_supported()
    check_logprobs(ctx, body.logprobs, "logprobs")
    prompt = body.single_prompt()
    # An explicit `max_tokens: null` is the default 16, as vLLM 0.33 answers it (not "to the context limit").
    # The model's max_new_tokens is no default here: the field's own default is 16 (vLLM's CompletionRequest).
    max_tokens = effective_max_tokens(16 if body.max_tokens is None else body.max_tokens, ctx.sampling_defaults)
    params = body.to_sampling_params(max_tokens, body.logprobs, ctx.sampling_defaults)
    request_id = engine_request_id("cmpl", http_request, body.request_id)
    log_request(ctx, request_id, prompt, body)
    if isinstance(prompt, str):
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        token_ids = await ctx.engine.tokenize(prompt, add_special_tokens=add_special)
        ctx.metrics.observe_tokenization(time.monotonic() - arrival_s)
    else:
        token_ids = prompt
    echo_text = None
    if body.echo:
        echo_text = prompt if isinstance(prompt, str) else await ctx.engine.detokenize(token_ids)
    request = GenerateRequest(request_id=request_id, prompt_token_ids=token_ids,
                              sampling_params=params, priority=body.priority, cache_salt=body.cache_salt,
                              arrival_s=arrival_s)
    return PreparedCompletion(request=request, created=int(time.time()), echo_text=echo_text,
                              include_usage=body.include_usage_in_stream or ctx.config.force_include_usage,
                              want_logprobs=body.logprobs is not None, response_id=_response_id(request_id, http_request, body),
                              continuous_usage=body.continuous_usage)


def _response_id(request_id: str, http_request: Request, body: CompletionRequest) -> str:
    given = http_request.headers.get("x-request-id") or body.request_id
    return f"cmpl-{given}" if given else request_id


async def create_completion(ctx: ServingContext, body: CompletionRequest, http_request: Request) -> Response:
    prepared = await prepare_completion(ctx, body, http_request)
    renderer = ResponseRenderer(chunks=functools.partial(_chunks, ctx, prepared),
                                collect=functools.partial(_collect, ctx, prepared))
    choices = fan_out(prepared.request, body.n or 1)
    streams = open_streams(ctx.engine, choices, ctx.gate)
    ctx.metrics.track_request(choices)
    return await respond(streams, http_request, bool(body.stream), renderer)


async def _collect(ctx: ServingContext, prepared: PreparedCompletion, streams: list[EngineStream],
                   firsts: list[RequestOutput]) -> CompletionResponse:
    runs = await drain_all(streams, firsts)
    choices = [_collected_choice(prepared, index, outputs) for index, outputs in enumerate(runs)]
    return CompletionResponse(id=prepared.response_id, created=prepared.created, model=ctx.model_name,
                              choices=choices, usage=total_usage(ctx, [outputs[-1] for outputs in runs]))


def _collected_choice(prepared: PreparedCompletion, index: int, outputs: list[RequestOutput]) -> CompletionChoice:
    last = outputs[-1]
    texts = [prepared.echo_text] if prepared.echo_text is not None else []
    texts.extend(output.new_text for output in outputs)
    logprobs = CompletionLogprobs() if prepared.want_logprobs else None
    offset = 0
    for output in outputs:
        if logprobs is not None:
            offset = logprobs.extend(output.new_logprobs, offset)
    return CompletionChoice(index=index, text="".join(texts), logprobs=logprobs,
                            finish_reason=finish_reason_text(last), stop_reason=last.stop_reason)


def _chunk(ctx: ServingContext, prepared: PreparedCompletion, choices: list[CompletionChoice],
           usage: UsageInfo | None = None) -> str:
    return sse(CompletionResponse(id=prepared.response_id, created=prepared.created,
                                  model=ctx.model_name, choices=choices, usage=usage))


def _chunks(ctx: ServingContext, prepared: PreparedCompletion, streams: list[EngineStream],
            firsts: list[RequestOutput]) -> AsyncGenerator[str, None]:
    echo = [_chunk(ctx, prepared, [CompletionChoice(index=index, text=prepared.echo_text)])
            for index in range(len(streams)) if prepared.echo_text]
    offsets = [0] * len(streams)  # each choice's running text offset, for its logprobs

    def event(index: int, output: RequestOutput, lasts: list[RequestOutput]) -> str:
        logprobs = None
        if prepared.want_logprobs:
            logprobs = CompletionLogprobs()
            offsets[index] = logprobs.extend(output.new_logprobs, offsets[index])
        choice = CompletionChoice(index=index, text=output.new_text, logprobs=logprobs,
                                  finish_reason=finish_reason_text(output), stop_reason=output.stop_reason)
        return _chunk(ctx, prepared, [choice], total_usage(ctx, lasts) if prepared.continuous_usage else None)

    closing = functools.partial(_usage_chunk, ctx, prepared) if prepared.include_usage else None
    return sse_events(streams, firsts, echo, event, closing)


def _usage_chunk(ctx: ServingContext, prepared: PreparedCompletion, lasts: list[RequestOutput]) -> str:
    return _chunk(ctx, prepared, [], total_usage(ctx, lasts))
