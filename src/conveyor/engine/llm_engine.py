"""The synchronous engine: `EngineCore` plus tokenizer and output processing, in one thread.

`LLM` (offline) drives it directly; `AsyncEngine` drives it from its engine thread. It turns prompts
into admitted `Request`s (validating lengths and token ids first, with errors that name the field),
and every step into caller-facing `RequestOutput`s and `FinishedRequestStats`. Stop strings matched
by the detokenizer are finished in the scheduler here, within the same step, so their blocks are
freed before the next `schedule()`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from conveyor.config import EngineConfig
from conveyor.core.errors import AdmissionError, QueueFullError
from conveyor.core.stats import SchedulerStats
from conveyor.engine.engine_core import EngineCore
from conveyor.engine.output_processor import OutputProcessor, ProcessedOutputs
from conveyor.engine.types import (
    EngineOverloadedError,
    FinishedRequestStats,
    GenerateRequest,
    RequestOutput,
    RequestRejectedError,
)
from conveyor.request import FinishReason, Request
from conveyor.sampling_params import SamplingParams


class TextTokenizer(Protocol):
    """What the engine needs from `engine.tokenizer.Tokenizer`."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class PreparedRequest:
    """A request that passed validation: token ids known, lengths checked."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None


@dataclass(frozen=True)
class EngineStep:
    """What one step means to callers."""

    request_outputs: list[RequestOutput]
    stats: SchedulerStats
    finished_stats: list[FinishedRequestStats] = field(default_factory=list)


@dataclass(frozen=True)
class RequestLimits:
    """What a request must fit in."""

    max_model_len: int
    """Prompt + output tokens must not exceed this."""
    vocab_size: int
    """Token ids must be in [0, vocab_size)."""


def validate_prompt(prompt_token_ids: list[int], params: SamplingParams, limits: RequestLimits) -> None:
    """Raise RequestRejectedError (naming `prompt` or `max_tokens`) if the request can never be served."""
    num_prompt = len(prompt_token_ids)
    if num_prompt == 0:
        raise RequestRejectedError("prompt", "prompt must contain at least one token")
    bad = next((t for t in prompt_token_ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise RequestRejectedError("prompt", f"token id {bad} is out of range [0, {limits.vocab_size})")
    limit = limits.max_model_len
    if num_prompt > limit or (num_prompt == limit and params.max_tokens is None):
        raise RequestRejectedError(
            "prompt", f"prompt has {num_prompt} tokens; this model's maximum context length (max_model_len) "
            f"is {limit} tokens and at least one must remain for the output")
    if params.max_tokens is not None and num_prompt + params.max_tokens > limit:
        raise RequestRejectedError(
            "max_tokens", f"prompt ({num_prompt} tokens) + max_tokens ({params.max_tokens}) = "
            f"{num_prompt + params.max_tokens} exceeds max_model_len={limit}; lower max_tokens "
            f"to at most {limit - num_prompt}")


class LLMEngine:
    """Synchronous engine; not thread-safe (one thread drives it)."""

    def __init__(self, core: EngineCore, tokenizer: TextTokenizer) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.limits = RequestLimits(core.limits.max_model_len, core.limits.vocab_size)
        self._eos_token_id = core.limits.eos_token_ids[0] if core.limits.eos_token_ids else None
        self._processor = OutputProcessor(tokenizer, core.config.scheduler.queue_timeout_s)
        self._pending = ProcessedOutputs()

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        from conveyor.engine.model_setup import build_core_and_tokenizer

        core, tokenizer = build_core_and_tokenizer(config)
        return cls(core, tokenizer)

    @property
    def config(self) -> EngineConfig:
        return self.core.config

    def prepare(self, request: GenerateRequest) -> PreparedRequest:
        """Tokenize and validate (no engine state touched: callable from any thread)."""
        if isinstance(request.prompt, str):
            prompt_ids = self.tokenizer.encode(request.prompt)
        else:
            prompt_ids = list(request.prompt)
        validate_prompt(prompt_ids, request.sampling_params, self.limits)
        return PreparedRequest(request.request_id, prompt_ids, request.sampling_params,
                               request.priority, request.cache_salt)

    def add_request(self, prepared: PreparedRequest, arrival_s: float | None = None) -> None:
        """Admit into the scheduler; raises RequestRejectedError / EngineOverloadedError."""
        if self._processor.has_request(prepared.request_id):
            raise RequestRejectedError("request_id", f"request id {prepared.request_id!r} is already running")
        arrival = time.monotonic() if arrival_s is None else arrival_s
        request = Request(prepared.request_id, prepared.prompt_token_ids, prepared.sampling_params, arrival,
                          eos_token_id=self._eos_token_id, priority=prepared.priority,
                          cache_salt=prepared.cache_salt)
        try:
            self.core.add_request(request)
        except AdmissionError as error:
            raise RequestRejectedError(error.field, error.message) from None
        except QueueFullError as error:
            raise EngineOverloadedError(str(error)) from None
        self._processor.add_request(prepared.request_id, prepared.prompt_token_ids,
                                    prepared.sampling_params, arrival)

    def abort(self, request_ids: list[str]) -> None:
        """Finish these requests now; their final outputs come with the next `step()`."""
        live = [rid for rid in request_ids if self._processor.has_request(rid)]
        self._merge(self._processor.process(self.core.abort(live)))

    def step(self) -> EngineStep:
        result = self.core.step()
        processed = self._processor.process(result.outputs)
        stopped = processed.stop_string_request_ids
        if stopped:
            self._merge_into(processed, self._processor.process(self.core.abort(stopped, FinishReason.STOP)))
        pending, self._pending = self._pending, ProcessedOutputs()
        self._merge_into(pending, processed)
        return EngineStep(pending.request_outputs, result.stats, pending.finished_stats)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests() or bool(self._pending.request_outputs)

    @property
    def num_live_requests(self) -> int:
        return self._processor.num_requests

    def live_request_ids(self) -> list[str]:
        return self._processor.live_request_ids()

    def take_pending_outputs(self) -> list[RequestOutput]:
        """Outputs produced outside `step()` (by `abort`) not yet returned."""
        pending, self._pending = self._pending, ProcessedOutputs()
        return pending.request_outputs

    def fail_all(self, message: str) -> list[RequestOutput]:
        """After a crash: final ERROR outputs for every live request."""
        return self._processor.fail_all(message)

    def _merge(self, extra: ProcessedOutputs) -> None:
        self._merge_into(self._pending, extra)

    @staticmethod
    def _merge_into(target: ProcessedOutputs, extra: ProcessedOutputs) -> None:
        target.request_outputs.extend(extra.request_outputs)
        target.finished_stats.extend(extra.finished_stats)
