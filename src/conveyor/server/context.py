"""What every endpoint handler needs (engine, served name, limits, admission gate) and shared checks."""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.engine.types import EngineClient, RequestOutput
from conveyor.request import FinishReason
from conveyor.server.errors import APIError, ErrorType, bad_request
from conveyor.server.lifecycle import AdmissionGate
from conveyor.server.metrics import ServerMetrics


@dataclass(frozen=True)
class ServingContext:
    """The state the handlers share; built once by `build_app`."""

    engine: EngineClient
    """The engine behind the server."""
    model_name: str
    """The one name clients may send in `model`."""
    max_model_len: int
    """Longest prompt + output, from the engine."""
    gate: AdmissionGate
    """In-flight accounting and draining."""
    metrics: ServerMetrics
    """Prometheus metrics (the server's own counters are bumped by the handlers)."""

    def check_model(self, requested: str | None) -> None:
        """404 unless `requested` is the served model (None means the served model, as vLLM)."""
        if requested is not None and requested != self.model_name:
            raise APIError(404, f"The model `{requested}` does not exist.", ErrorType.NOT_FOUND, param="model")


def check_prompt_length(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int,
                        prompt_field: str) -> None:
    """400 if the prompt leaves no room for output, or prompt + max_tokens exceeds max_model_len."""
    if num_prompt_tokens >= max_model_len:
        raise bad_request(
            f"{prompt_field}: the prompt has {num_prompt_tokens} tokens but max_model_len is {max_model_len}; "
            "prompt plus at least one output token must fit, shorten the prompt", prompt_field)
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise bad_request(
            f"max_tokens: this model's maximum context length (max_model_len) is {max_model_len} tokens, "
            f"but you requested {num_prompt_tokens + max_tokens} ({num_prompt_tokens} in the prompt, "
            f"{max_tokens} in max_tokens); reduce max_tokens or the prompt", "max_tokens")


def finish_reason_text(output: RequestOutput) -> str | None:
    """OpenAI's finish_reason: "stop" or "length" (an aborted request reports "abort", as vLLM)."""
    if output.finish_reason is None:
        return None
    if output.finish_reason in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT):
        return output.finish_reason.value
    return "stop"
