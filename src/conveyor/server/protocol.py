"""OpenAI request bodies (completions, chat completions, tokenize) and their conversion to `SamplingParams`.

Types are strict: `"0.5"` is not a temperature and `1.5` is not a token count. Every field of vLLM
0.32's requests is declared: honoured, or accepted only at its default (request_fields.DEFAULT_ONLY,
400 naming it otherwise); an unknown field is a 400 naming it (vLLM ignores unknown fields with a
warning: a typo silently does nothing). Range checks live in `SamplingParams` alone; its `ValueError`
messages start with the field name, so they become 400s naming the field unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from conveyor.engine.generation_defaults import NO_SAMPLING_DEFAULTS, SamplingDefaults
from conveyor.sampling_params import INT64_MAX, MAX_LOGIT_BIAS, SamplingParams
from conveyor.server.errors import bad_request, from_value_error
from conveyor.server.request_fields import CHAT_DEFAULT_ONLY, DEFAULT_ONLY, check_defaults, structured_output_of

_SAMPLING_FIELDS = {
    "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "max_tokens", "min_tokens", "stop", "stop_token_ids", "logprobs", "logit_bias",
}
_STRICT = ConfigDict(extra="forbid", strict=True)
Int64 = Annotated[int, Field(ge=-INT64_MAX - 1, le=INT64_MAX)]
"""Integers travel to the engine core as int64."""
MAX_N = 128
"""Most sequences one request may ask for (n)."""


class StreamOptions(BaseModel):
    """`stream_options` (only meaningful with `stream: true`)."""

    model_config = _STRICT
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = _STRICT
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int64 = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    user: str | None = None
    """OpenAI's end-user id: logged with --enable-log-requests, never used to generate."""
    session_id: str | None = None
    """vLLM's session id (routing metadata): logged, never used to generate."""
    request_id: str | None = None
    """The response id's suffix (the X-Request-Id header wins, as vLLM)."""
    priority: Int64 = 0
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    """vLLM's prefix-cache namespace: mixed into the hash of the prompt's first KV block, so requests with
    different salts share no cached blocks (benchmark runs, tenants). "" is refused, as vLLM does."""
    n: Int64 | None = 1
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    """Any backend name is served by llguidance."""
    guided_whitespace_pattern: str | None = None
    add_special_tokens: bool | None = None
    """None: the endpoint's default (completions: true, chat: false, as vLLM)."""
    use_beam_search: Any = False
    length_penalty: Any = 1.0
    watermarking: Any = None
    spaces_between_special_tokens: Any = True
    truncate_prompt_tokens: Any = None
    truncation_side: Any = None
    allowed_token_ids: Any = None
    prompt_logprobs: Any = None
    logprob_token_ids: Any = None
    bad_words: Any = None
    prompt_embeds: Any = None
    return_tokens_as_token_ids: Any = None
    return_token_ids: Any = None
    routed_experts_prompt_start: Any = 0
    return_token_offsets: Any = None
    mm_payload: Any = "tensors"
    return_mm_kwargs: Any = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None
    vllm_xargs: Any = None
    repetition_detection: Any = None
    thinking_token_budget: Any = None
    stream_interval: Any = None

    def check_supported(self) -> None:
        """Reject fields that are well-typed but would change the answer in ways we do not implement."""
        check_defaults(self, DEFAULT_ONLY)
        if self.n is None or not 1 <= self.n <= MAX_N:
            raise bad_request(f"n: must be in [1, {MAX_N}] (got {self.n})", "n")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options: only allowed when stream is true", "stream_options")

    def _sampling_values(self, defaults: SamplingDefaults) -> dict[str, Any]:
        """The request's sampling fields over the model's defaults (vLLM: user -> server default -> built-in)."""
        given = {
            "temperature": (self.temperature, defaults.temperature), "top_p": (self.top_p, defaults.top_p),
            "min_p": (self.min_p, defaults.min_p), "top_k": (self.top_k, defaults.top_k),
            "repetition_penalty": (self.repetition_penalty, defaults.repetition_penalty),
            "presence_penalty": (self.presence_penalty, None), "frequency_penalty": (self.frequency_penalty, None),
            "seed": (self.seed, None),
        }
        values: dict[str, Any] = {name: value if value is not None else default
                                  for name, (value, default) in given.items()}
        values["top_k"] = None if values["top_k"] in (-1, 0) else values["top_k"]  # vLLM's "no top-k": -1 or 0
        return {name: value for name, value in values.items() if value is not None or name == "top_k"}

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.continuous_usage_stats)

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """logit_bias with integer token ids, values clamped to [-100, 100] (vLLM, OpenAI)."""
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            if not key.strip().isdigit():
                raise bad_request(f"logit_bias: keys must be token ids (got {key!r})", "logit_bias")
            pairs.append((int(key), min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, bias))))
        return tuple(pairs)

    def to_sampling_params(self, max_tokens: int | None, logprobs: int | None,
                           defaults: SamplingDefaults = NO_SAMPLING_DEFAULTS) -> SamplingParams:
        """The engine's SamplingParams; a field the request leaves unset takes the model's default
        (--generation-config), else SamplingParams' own (vLLM's); a range error is a 400 naming the field."""
        values = self._sampling_values(defaults)
        if (self.n or 1) > 1 and values.get("temperature") == 0:  # the effective temperature, as vLLM checks it
            raise bad_request(f"n: must be 1 with greedy sampling (temperature 0), got {self.n}", "n")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        try:
            return SamplingParams(
                **values, max_tokens=max_tokens, min_tokens=self.min_tokens, stop=tuple(stop),
                stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
                logprobs=logprobs, include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens, logit_bias=self.logit_bias_pairs(),
                structured_output=structured_output_of(self),
            )
        except ValueError as error:
            raise from_value_error(error, _SAMPLING_FIELDS) from None


def _is_token_ids(value: object) -> bool:
    return isinstance(value, list) and all(type(item) is int for item in value)


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Int64 | None = 16
    logprobs: Int64 | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: Int64 | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: object) -> object:
        ok = isinstance(value, str) or _is_token_ids(value) or (
            isinstance(value, list) and all(isinstance(v, str) or _is_token_ids(v) for v in value))
        if not ok:
            raise ValueError("must be a string, a list of token ids, or a list holding one of either")
        return value

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of not in (None, 1):
            raise bad_request(f"best_of: only 1 is supported (got {self.best_of})", "best_of")
        if self.suffix:
            raise bad_request("suffix: not supported", "suffix")
        if self.echo and self.logprobs is not None:
            raise bad_request("echo: prompt logprobs are not supported; use echo or logprobs, not both",
                              "echo")

    def single_prompt(self) -> str | list[int]:
        """The one prompt, as text or token ids; batches of several prompts are rejected."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt
        if prompt and not _is_token_ids(prompt):  # a list of prompts: only a batch of one is served
            if len(prompt) != 1:
                raise bad_request(f"prompt: a batch of {len(prompt)} prompts is not supported; "
                                  "send one request per prompt", "prompt")
            prompt = prompt[0]
            if isinstance(prompt, str):
                return prompt
        if not prompt:
            raise bad_request("prompt: must not be empty", "prompt")
        if any(token_id < 0 for token_id in prompt):  # type: ignore[operator]
            raise bad_request("prompt: token ids must be >= 0", "prompt")
        return prompt  # type: ignore[return-value]


class TextPart(BaseModel):
    """One `{"type": "text", "text": ...}` part of a message's content."""

    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message; only text content is supported (images, audio: 400 naming the part)."""

    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None
    """A participant's name, as OpenAI: accepted (the chat template decides whether to show it)."""

    @field_validator("content", mode="before")
    @classmethod
    def _content_shape(cls, value: object) -> object:
        if isinstance(value, str):
            return value
        parts_ok = isinstance(value, list) and all(
            isinstance(p, dict) and p.get("type") == "text" for p in value)
        if not parts_ok:
            raise ValueError('must be a string or a list of {"type": "text", "text": ...} parts')
        return value

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: Int64 | None = None
    max_tokens: Int64 | None = None
    logprobs: bool | None = False
    top_logprobs: Int64 | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    parallel_tool_calls: bool | None = True
    """Only meaningful with tools, which are refused: accepted as is."""
    include_reasoning: bool = True
    """No reasoning parser runs: the model's text is all `content` either way."""
    add_generation_prompt: bool = True
    reasoning_effort: Any = None
    echo: Any = False
    continue_final_message: Any = False
    documents: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    media_io_kwargs: Any = None
    mm_processor_kwargs: Any = None
    return_prompt_text: Any = None
    function_call: Any = None

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not value:
            raise ValueError("must contain at least one message")
        return value

    def check_supported(self) -> None:
        super().check_supported()
        check_defaults(self, CHAT_DEFAULT_ONLY)
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise bad_request(f"{name}: tool calling is not supported", name)
        if self.tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice: tool calling is not supported", "tool_choice")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs: requires logprobs to be true", "top_logprobs")

    def requested_max_tokens(self) -> int | None:
        """`max_completion_tokens` wins over the deprecated `max_tokens` (as OpenAI)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    def template_messages(self) -> list[dict[str, str]]:
        messages = []
        for m in self.messages:
            message = {"role": m.role, "content": m.text()}
            if m.name is not None:
                message["name"] = m.name
            messages.append(message)
        return messages


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's): either `prompt` or `messages`."""

    model_config = _STRICT
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    def check_supported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("prompt: give exactly one of prompt or messages", "prompt")


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's)."""

    model_config = _STRICT
    model: str | None = None
    tokens: list[int]



def effective_max_tokens(requested: int | None, defaults: SamplingDefaults) -> int | None:
    """vLLM's get_max_tokens: the request's max_tokens, else the model's default; under the cap of
    --override-generation-config (or PATH's) max_new_tokens either way. None: the rest of max_model_len."""
    chosen = requested if requested is not None else defaults.max_tokens
    cap = defaults.max_tokens_cap
    if cap is None:
        return chosen
    return cap if chosen is None else min(chosen, cap)


def fit_default_max_tokens(params: SamplingParams, requested: int | None, room: int) -> SamplingParams:
    """A max_tokens the request did not ask for (the model's default) past the room its prompt leaves in
    max_model_len is cut to that room, as vLLM's get_max_tokens takes the min (an asked-for one past it
    stays a 400). The room is spelled None, "the rest of max_model_len", which also keeps the error of a
    prompt that leaves none about the prompt."""
    if requested is not None or params.max_tokens is None or params.max_tokens <= room:
        return params
    return dataclasses.replace(params, max_tokens=None)
