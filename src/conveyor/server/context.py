"""What every endpoint handler needs (engine, served name, limits, admission gate) and shared checks."""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.engine.types import EngineClient, RequestOutput
from conveyor.request import FinishReason
from conveyor.server.errors import APIError, ErrorType
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


def finish_reason_text(output: RequestOutput) -> str | None:
    """OpenAI's finish_reason: "stop" or "length" (an aborted request reports "abort", as vLLM)."""
    if output.finish_reason is None:
        return None
    if output.finish_reason in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT):
        return output.finish_reason.value
    return "stop"
