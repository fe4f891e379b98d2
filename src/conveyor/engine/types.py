"""The engine's asynchronous interface, as the server sees it: plain dataclasses and a Protocol.

This module imports no torch (the server depends on it and must stay torch-free). The real
implementation is `engine.async_engine.AsyncEngine`; tests may pass any object with this shape.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from conveyor.core.outputs import TokenLogprobs
from conveyor.core.stats import SchedulerStats
from conveyor.request import FinishReason, RequestTimings
from conveyor.sampling_params import SamplingParams


class EngineError(Exception):
    """Base of the errors the engine reports to its callers."""


class RequestRejectedError(EngineError):
    """The request can never be served as asked (HTTP 400); `field` names the offending input."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field = field_name


class EngineOverloadedError(EngineError):
    """The waiting queue is full (HTTP 503 with Retry-After)."""


class EngineDeadError(EngineError):
    """The engine loop has stopped (crashed or shut down): nothing more will be served."""


@dataclass(frozen=True)
class GenerateRequest:
    """One request submitted to the engine; `prompt` is text or token ids."""

    request_id: str
    prompt: str | list[int]
    sampling_params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None


@dataclass(frozen=True)
class LogprobEntry:
    """One generated position's log-probabilities, with token strings for the OpenAI wire format."""

    token: str
    token_id: int
    logprob: float
    top: list[tuple[str, float]]


@dataclass(frozen=True)
class RequestOutput:
    """A streamed increment of one request. The last one has `finish_reason` set."""

    request_id: str
    new_text: str
    """Text added since the previous output (never splits a UTF-8 character)."""
    new_token_ids: list[int]
    num_prompt_tokens: int
    num_output_tokens: int
    """Output tokens so far (cumulative)."""
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error_message: str | None = None
    """Set when finish_reason is QUEUE_TIMEOUT or ERROR: what went wrong, for the client."""
    new_logprobs: list[LogprobEntry] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    """Set on the first output only (for `echo` and usage accounting)."""
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class FinishedRequestStats:
    """A finished request's numbers, for the latency histograms and success counters."""

    finish_reason: FinishReason
    timings: RequestTimings
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    request_id: str = ""
    """Which request (lets offline callers attach timings to their results)."""


StatsListener = Callable[[SchedulerStats, list[FinishedRequestStats]], None]
"""Called after every engine step (from the engine's thread: keep it fast and thread-safe)."""


@dataclass(frozen=True)
class EngineInfo:
    """What the engine resolved at start-up, for logs, /v1/models and the config info metric."""

    model_name: str
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    config: dict[str, str]
    """Resolved configuration as flat strings (flag name -> value)."""

    @property
    def num_kv_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        """Requests of max_model_len tokens that fit in the KV cache at once."""
        return self.num_kv_tokens / self.max_model_len

    @property
    def num_speculative_tokens(self) -> int:
        """K of speculative decoding, from the resolved --speculative-config JSON (0: off)."""
        text = self.config.get("speculative-config", "none")
        return 0 if text == "none" else int(json.loads(text)["num_speculative_tokens"])


class EngineClient(Protocol):
    """What the server needs from an engine."""

    @property
    def info(self) -> EngineInfo: ...

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def detokenize(self, token_ids: list[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str: ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Submit and stream. Raises RequestRejectedError / EngineOverloadedError before the first
        output; closing the iterator early (client gone) aborts the request."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def add_stats_listener(self, listener: StatsListener) -> None: ...

    def num_unfinished_requests(self) -> int: ...

    @property
    def is_running(self) -> bool:
        """False once the engine loop has crashed or shut down (the server's /health turns 503)."""
        ...

    async def shutdown(self) -> None: ...
