"""The engine's asynchronous interface, as the server sees it: plain dataclasses and a Protocol.

This module imports no torch (the server depends on it and must stay torch-free). The real
implementation is `engine.core_client.AsyncEngineClient` (the API-process half of the split engine);
tests may pass any object with this shape.
"""

from __future__ import annotations

import enum
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from conveyor.core.outputs import TokenLogprobs
from conveyor.core.stats import SchedulerStats
from conveyor.core.step_log import StepRecord
from conveyor.request import FinishReason, RequestTimings
from conveyor.sampling_params import SamplingParams


class EngineError(Exception):
    """Base of the errors the engine reports to its callers."""


class RequestRejectedError(EngineError):
    """The request can never be served as asked (HTTP 400); `field` names the offending input."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field = field_name


class OverloadReason(enum.Enum):
    """Which admission limit refused a request: vLLM's `vllm:admission_rejections{reason}` labels."""

    MAX_NUM_QUEUED_REQS = "max_num_queued_reqs"
    """In-flight requests (waiting + running) already at --max-num-queued-reqs."""
    MAX_NUM_QUEUED_TOKENS = "max_num_queued_tokens"
    """Prompt tokens of requests still in prefill already at --max-num-queued-tokens."""


class EngineOverloadedError(EngineError):
    """An admission limit is reached (HTTP 503 with Retry-After); `reason` says which."""

    def __init__(self, reason: OverloadReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class EngineDeadError(EngineError):
    """The engine core has stopped (crashed, killed or shut down): nothing more will be served."""


@dataclass(frozen=True)
class GenerateRequest:
    """One request submitted to the engine, already tokenized (the server tokenizes off the event loop)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    arrival_s: float | None = None
    """time.monotonic() when the request arrived (None: now); queue time and TTFT count from here."""


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
    error_param: str | None = None
    """The request field an ERROR is about when the request's own input caused it (its grammar could not
    be followed): the client gets a 400 naming it, not a 500."""
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


@dataclass(frozen=True)
class IterationStats:
    """What one engine step tells this front end's metrics."""

    scheduler: SchedulerStats | None
    """The engine's state after the step; None in the front ends that do not report it (with
    --api-server-count N > 1 exactly one front end receives it, so counters are not counted N times)."""
    finished: list[FinishedRequestStats] = field(default_factory=list)
    """This front end's requests that finished with the step."""
    peak_memory_bytes: int | None = None
    """The engine process's peak device memory: torch.cuda.max_memory_reserved() on CUDA, its peak resident
    set size on CPU (None without scheduler stats)."""


StatsListener = Callable[[IterationStats], None]
"""Called once per engine step that has news for this front end (on its event loop: keep it fast)."""


@dataclass(frozen=True)
class EngineInfo:
    """What the engine resolved at start-up, for logs, /v1/models and the config info metric."""

    model_name: str
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    vocab_size: int
    """Prompt token ids must be below this."""
    config: dict[str, str]
    """Resolved configuration as flat strings (flag name -> value)."""
    model_path: str | None = None
    """The model file or directory the engine loaded (the embedded GGUF when --model is not given)."""
    device_name: str | None = None
    """"cpu", or the CUDA device's name (for conveyor:gpu_info where NVML is missing)."""
    dtype: str | None = None
    """The dtype the weights compute in, resolved from --dtype (e.g. "bfloat16"; for conveyor:model_info)."""

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

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Off the event loop (a thread pool): a 4 MB prompt must not stall other connections."""
        ...

    async def detokenize(self, token_ids: list[int]) -> str: ...

    async def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str: ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Admit and submit now: raises RequestRejectedError / EngineOverloadedError / EngineDeadError
        before returning (the one admission decision); closing the iterator early (client gone)
        aborts the request."""
        ...

    async def abort(self, request_id: str) -> None:
        """End a request; its stream receives a final ABORT output."""
        ...

    async def check_health(self, timeout_s: float) -> bool:
        """Whether the engine core answers within `timeout_s` (False once dead, or while it is frozen)."""
        ...

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's: forget the engine core's prefix cache; False (nothing reset) while requests hold KV
        blocks, unless `reset_running_requests` preempts them first (recomputed, outputs unchanged)."""
        ...

    async def drain_step_log(self) -> list[StepRecord] | None:
        """The engine core's step records since the last drain, oldest first; None when --step-log-size is 0."""
        ...

    def add_stats_listener(self, listener: StatsListener) -> None: ...

    def num_unfinished_requests(self) -> int: ...

    def add_dead_listener(self, listener: Callable[[], None]) -> None:
        """Called once, on the event loop, when the engine core dies (the server then exits non-zero)."""
        ...

    @property
    def is_running(self) -> bool:
        """False once the engine core has died or shut down (the server's /health turns 503)."""
        ...

    async def shutdown(self) -> None: ...
