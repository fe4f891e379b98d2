"""POST /v1/chat/completions: messages -> chat template -> engine -> one response or an SSE stream.

The template's text is tokenized without special tokens (the template already holds them), as vLLM
does. Without `max_completion_tokens`/`max_tokens` the answer may use the rest of `max_model_len`.
A stream opens with a role-only delta, then content deltas; the last content chunk carries
`finish_reason`; with `include_usage` a final chunk with empty `choices` carries the usage.
"""

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
from conveyor.server.errors import APIError, bad_request
from conveyor.server.generation import (
    EngineStream,
    ResponseRenderer,
    drain,
    failed_output_error,
    respond,
)
from conveyor.server.protocol import ChatCompletionRequest
from conveyor.server.responses import (
    SSE_DONE,
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


async def render_chat_prompt(ctx: ServingContext, body: ChatCompletionRequest) -> list[int]:
    """Messages -> template text -> token ids (off the event loop); a template failure is the
    messages' fault (400)."""
    try:
        text = await ctx.engine.apply_chat_template(body.template_messages(), body.add_generation_prompt)
    except Exception as error:  # jinja raises its own types; all mean "these messages do not fit"
        raise bad_request(f"messages: the chat template rejected them: {error}", "messages") from None
    return await ctx.engine.tokenize(text, add_special_tokens=False)


async def prepare_chat(ctx: ServingContext, body: ChatCompletionRequest) -> PreparedChat:
    """Validate, template and tokenize; the engine admits it."""
    arrival_s = time.monotonic()
    body.check_supported()
    params = body.to_sampling_params(body.requested_max_tokens(), body.num_logprobs())
    token_ids = await render_chat_prompt(ctx, body)
    ctx.metrics.observe_tokenization(time.monotonic() - arrival_s)
    if not token_ids:
        raise bad_request("messages: the rendered prompt is empty", "messages")
    request = GenerateRequest(request_id=f"chatcmpl-{uuid.uuid4().hex}", prompt_token_ids=token_ids,
                              sampling_params=params, priority=body.priority, cache_salt=body.cache_salt,
                              arrival_s=arrival_s)
    return PreparedChat(request=request, created=int(time.time()),
                        include_usage=body.include_usage_in_stream, want_logprobs=body.logprobs)


async def create_chat_completion(ctx: ServingContext, body: ChatCompletionRequest,
                                 http_request: Request) -> Response:
    prepared = await prepare_chat(ctx, body)
    renderer = ResponseRenderer(chunks=functools.partial(_chunks, ctx, prepared),
                                collect=functools.partial(_collect, ctx, prepared))
    stream = EngineStream(ctx.engine, prepared.request, ctx.gate, prompt_param="messages")
    return await respond(stream, http_request, body.stream, renderer)


async def _collect(ctx: ServingContext, prepared: PreparedChat, stream: EngineStream,
                   first: RequestOutput) -> ChatCompletionResponse:
    outputs = await drain(stream, first)
    last = outputs[-1]
    entries = [entry for output in outputs for entry in output.new_logprobs]
    logprobs = ChatChoiceLogprobs.of(entries) if prepared.want_logprobs else None
    text = "".join(output.new_text for output in outputs)
    choice = ChatChoice(message=ChatMessageOut(content=text), logprobs=logprobs,
                        finish_reason=finish_reason_text(last), stop_reason=last.stop_reason)
    return ChatCompletionResponse(id=prepared.request.request_id, created=prepared.created,
                                  model=ctx.model_name, choices=[choice],
                                  usage=UsageInfo.of(last.num_prompt_tokens, last.num_output_tokens))


def _chunk(ctx: ServingContext, prepared: PreparedChat, choices: list[ChatStreamChoice],
           usage: UsageInfo | None = None) -> str:
    return sse(ChatCompletionChunk(id=prepared.request.request_id, created=prepared.created,
                                   model=ctx.model_name, choices=choices, usage=usage))


def _content_choice(prepared: PreparedChat, output: RequestOutput) -> ChatStreamChoice:
    logprobs = ChatChoiceLogprobs.of(output.new_logprobs) if prepared.want_logprobs else None
    return ChatStreamChoice(delta=DeltaMessage(content=output.new_text), logprobs=logprobs,
                            finish_reason=finish_reason_text(output), stop_reason=output.stop_reason)


async def _chunks(ctx: ServingContext, prepared: PreparedChat, stream: EngineStream,
                  first: RequestOutput) -> AsyncGenerator[str, None]:
    yield _chunk(ctx, prepared, [ChatStreamChoice(delta=DeltaMessage(role="assistant", content=""))])
    last = first
    try:
        async for output in stream.rest(first):
            last = output
            error = failed_output_error(output)
            if error is not None:
                yield error.to_sse()
                return
            # Every new token gets a chunk, even one whose text the detokenizer holds back (as in vLLM).
            if output.new_token_ids or output.new_text or output.finished or output.new_logprobs:
                yield _chunk(ctx, prepared, [_content_choice(prepared, output)])
    except APIError as error:
        yield error.to_sse()
        return
    if prepared.include_usage:
        yield _chunk(ctx, prepared, [], UsageInfo.of(last.num_prompt_tokens, last.num_output_tokens))
    yield SSE_DONE
