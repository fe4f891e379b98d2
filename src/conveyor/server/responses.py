"""OpenAI response bodies and streaming chunks, field for field, so the official client parses them.

Every field is always serialized (`finish_reason: null`, `usage: null` on content chunks), which is
what OpenAI sends with `include_usage` and what its client expects either way.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, SerializerFunctionWrapHandler, model_serializer

from conveyor.engine.types import LogprobEntry


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int | None = None) -> UsageInfo:
        """`num_cached_tokens` (prefix-cache hits) is reported only when given (--enable-prompt-tokens-details)."""
        details = PromptTokensDetails(cached_tokens=num_cached_tokens) if num_cached_tokens is not None else None
        return cls(prompt_tokens=num_prompt_tokens, completion_tokens=num_output_tokens,
                   total_tokens=num_prompt_tokens + num_output_tokens, prompt_tokens_details=details)


# ---- completions -------------------------------------------------------------------------------

class CompletionLogprobs(BaseModel):
    """The legacy completions logprobs object: parallel lists, one entry per generated token."""

    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []

    def extend(self, entries: list[LogprobEntry], text_offset: int) -> int:
        """Append entries whose text starts at `text_offset`; returns the offset after them."""
        for entry in entries:
            self.tokens.append(entry.token)
            self.token_logprobs.append(entry.logprob)
            self.top_logprobs.append(dict(entry.top))
            self.text_offset.append(text_offset)
            text_offset += len(entry.token)
        return text_offset


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# ---- chat completions --------------------------------------------------------------------------

class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[ChatTopLogprob] = []

    @classmethod
    def of(cls, entry: LogprobEntry) -> ChatLogprob:
        top = [ChatTopLogprob(token=t, logprob=lp, bytes=list(t.encode())) for t, lp in entry.top]
        return cls(token=entry.token, logprob=entry.logprob, bytes=list(entry.token.encode()),
                   top_logprobs=top)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatLogprob] | None = None

    @classmethod
    def of(cls, entries: list[LogprobEntry]) -> ChatChoiceLogprobs:
        return cls(content=[ChatLogprob.of(entry) for entry in entries])


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    """A chat stream delta: `{"role": "assistant", "content": ""}` first, then `{"content": ...}` (no nulls)."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


# ---- models, tokenize ----------------------------------------------------------------------------

class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "conveyor"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def sse(chunk: BaseModel) -> str:
    """One server-sent event carrying `chunk`."""
    return f"data: {chunk.model_dump_json()}\n\n"


SSE_DONE = "data: [DONE]\n\n"
