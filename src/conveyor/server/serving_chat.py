"""POST /v1/chat/completions: messages -> chat template -> engine -> one response or an SSE stream.

The template's text is tokenized without special tokens (the template already holds them), as vLLM
does. Without `max_completion_tokens`/`max_tokens` the answer may use the rest of `max_model_len`.
A stream opens with a role-only delta, then content deltas; the last content chunk carries
`finish_reason`; with `include_usage` a final chunk with empty `choices` carries the usage.
"""

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
from conveyor.server.errors import bad_request
from conveyor.server.generation import (
    EngineStream,
    ResponseRenderer,
    drain_all,
    fan_out,
    open_streams,
    respond,
    sse_events,
)
from conveyor.server.protocol import (
    ChatCompletionRequest,
    effective_max_tokens,
    fit_default_max_tokens,
)
from conveyor.server.responses import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatMessageOut,
    ChatStreamChoice,
    DeltaMessage,
    UsageInfo,
    sse,
)


@dataclass(frozen=True)
class PreparedChat:
    """A validated chat request, templated and tokenized, ready for the engine."""

    request: GenerateRequest
    created: int
    include_usage: bool
    want_logprobs: bool
    response_id: str
    """The `id` the client sees (`chatcmpl-<X-Request-Id>` when it sent one)."""
    continuous_usage: bool = False
    """stream_options.continuous_usage_stats: usage on every chunk."""


async def render_chat_prompt(ctx: ServingContext, body: ChatCompletionRequest) -> list[int]:
    """Messages -> template text -> token ids (off the event loop); a template failure is the
    messages' fault (400)."""
    try:
        text = await ctx.engine.apply_chat_template(body.template_messages(), body.add_generation_prompt)
    except Exception as error:  # jinja raises its own types; all mean "these messages do not fit"
        raise bad_request(f"messages: the chat template rejected them: {error}", "messages") from None
    return await ctx.engine.tokenize(text, add_special_tokens=bool(body.add_special_tokens))


async def prepare_chat(ctx: ServingContext, body: ChatCompletionRequest, http_request: Request) -> PreparedChat:
    """Validate, template and tokenize; the engine admits it."""
    arrival_s = time.monotonic()
    body.check_supported()
    check_logprobs(ctx, body.top_logprobs, "top_logprobs")
    max_tokens = effective_max_tokens(body.requested_max_tokens(), ctx.sampling_defaults)
    params = body.to_sampling_params(max_tokens, body.num_logprobs(), ctx.sampling_defaults)
    request_id = engine_request_id("chatcmpl", http_request, body.request_id)
    log_request(ctx, request_id, body.template_messages()[-1]["content"], body)
    token_ids = await render_chat_prompt(ctx, body)
    ctx.metrics.observe_tokenization(time.monotonic() - arrival_s)
    if not token_ids:
        raise bad_request("messages: the rendered prompt is empty", "messages")
    params = fit_default_max_tokens(params, body.requested_max_tokens(), ctx.max_model_len - len(token_ids))
    request = GenerateRequest(request_id=request_id, prompt_token_ids=token_ids,
                              sampling_params=params, priority=body.priority, cache_salt=body.cache_salt,
                              arrival_s=arrival_s)
    given = http_request.headers.get("x-request-id") or body.request_id
    return PreparedChat(request=request, created=int(time.time()),
                        include_usage=body.include_usage_in_stream or ctx.config.force_include_usage,
                        want_logprobs=bool(body.logprobs), response_id=f"chatcmpl-{given}" if given else request_id,
                        continuous_usage=body.continuous_usage)


async def create_chat_completion(ctx: ServingContext, body: ChatCompletionRequest,
                                 http_request: Request) -> Response:
    prepared = await prepare_chat(ctx, body, http_request)
    renderer = ResponseRenderer(chunks=functools.partial(_chunks, ctx, prepared),
                                collect=functools.partial(_collect, ctx, prepared))
    choices = fan_out(prepared.request, body.n or 1)
    streams = open_streams(ctx.engine, choices, ctx.gate, prompt_param="messages")
    ctx.metrics.track_request(choices)
    return await respond(streams, http_request, bool(body.stream), renderer)


async def _collect(ctx: ServingContext, prepared: PreparedChat, streams: list[EngineStream],
                   firsts: list[RequestOutput]) -> ChatCompletionResponse:
    runs = await drain_all(streams, firsts)
    choices = [_collected_choice(prepared, index, outputs) for index, outputs in enumerate(runs)]
    return ChatCompletionResponse(id=prepared.response_id, created=prepared.created, model=ctx.model_name,
                                  choices=choices, usage=total_usage(ctx, [outputs[-1] for outputs in runs]))


def _collected_choice(prepared: PreparedChat, index: int, outputs: list[RequestOutput]) -> ChatChoice:
    last = outputs[-1]
    entries = [entry for output in outputs for entry in output.new_logprobs]
    logprobs = ChatChoiceLogprobs.of(entries) if prepared.want_logprobs else None
    text = "".join(output.new_text for output in outputs)
    return ChatChoice(index=index, message=ChatMessageOut(content=text), logprobs=logprobs,
                      finish_reason=finish_reason_text(last), stop_reason=last.stop_reason)


def _chunk(ctx: ServingContext, prepared: PreparedChat, choices: list[ChatStreamChoice],
           usage: UsageInfo | None = None) -> str:
    return sse(ChatCompletionChunk(id=prepared.response_id, created=prepared.created,
                                   model=ctx.model_name, choices=choices, usage=usage))


def _content_event(ctx: ServingContext, prepared: PreparedChat, index: int, output: RequestOutput,
                   lasts: list[RequestOutput]) -> str:
    logprobs = ChatChoiceLogprobs.of(output.new_logprobs) if prepared.want_logprobs else None
    choice = ChatStreamChoice(index=index, delta=DeltaMessage(content=output.new_text), logprobs=logprobs,
                              finish_reason=finish_reason_text(output), stop_reason=output.stop_reason)
    return _chunk(ctx, prepared, [choice], total_usage(ctx, lasts) if prepared.continuous_usage else None)


def _usage_chunk(ctx: ServingContext, prepared: PreparedChat, lasts: list[RequestOutput]) -> str:
    return _chunk(ctx, prepared, [], total_usage(ctx, lasts))


def _chunks(ctx: ServingContext, prepared: PreparedChat, streams: list[EngineStream],
            firsts: list[RequestOutput]) -> AsyncGenerator[str, None]:
    roles = [_chunk(ctx, prepared, [ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
             for index in range(len(streams))]
    closing = functools.partial(_usage_chunk, ctx, prepared) if prepared.include_usage else None
    return sse_events(streams, firsts, roles, functools.partial(_content_event, ctx, prepared), closing)
