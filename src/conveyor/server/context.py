"""What every endpoint handler needs (engine, served name, limits, admission gate) and shared checks."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

from starlette.requests import Request

from conveyor.engine.generation_defaults import NO_SAMPLING_DEFAULTS, SamplingDefaults
from conveyor.engine.types import EngineClient, RequestOutput
from conveyor.request import FinishReason
from conveyor.server.errors import APIError, ErrorType
from conveyor.server.lifecycle import AdmissionGate
from conveyor.server.metrics import ServerMetrics
from conveyor.server.middleware import request_id_of
from conveyor.server.responses import UsageInfo
from conveyor.server.server_config import ServerConfig

logger = logging.getLogger("conveyor.requests")


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
    config: ServerConfig = ServerConfig()
    """The server's flags (limits, response options)."""
    sampling_defaults: SamplingDefaults = NO_SAMPLING_DEFAULTS
    """The model's default sampling parameters (--generation-config), for request fields left unset."""

    def check_model(self, requested: str | None) -> None:
        """404 unless `requested` names the served model (None means the served model, as vLLM)."""
        if requested is not None and requested != self.model_name and requested not in self.config.served_model_names:
            raise APIError(404, f"The model `{requested}` does not exist.", ErrorType.NOT_FOUND, param="model")


def engine_request_id(prefix: str, http_request: Request, body_request_id: str | None) -> str:
    """`<prefix>-<id>`: the X-Request-Id header, else the body's request_id, else a random one (vLLM's
    rule), with a random suffix so two requests sent with the same id never collide in the engine."""
    given = http_request.headers.get("x-request-id") or body_request_id
    base = given if given else request_id_of(http_request.scope)
    return f"{prefix}-{base}-{uuid.uuid4().hex[:8]}" if given else f"{prefix}-{base}"


def check_logprobs(ctx: ServingContext, requested: int | None, field: str) -> None:
    if requested is not None and requested > ctx.config.max_logprobs:
        raise APIError(400, f"{field}: at most {ctx.config.max_logprobs} (the server's --max-logprobs), "
                            f"got {requested}", param=field)


def log_request(ctx: ServingContext, request_id: str, prompt: str | list[int], body: object) -> None:
    """--enable-log-requests: one line per request (prompt excerpt cut at --max-log-len)."""
    if not ctx.config.log_requests:
        return
    text = prompt if isinstance(prompt, str) else str(prompt)
    if ctx.config.max_log_len is not None:
        text = text[: ctx.config.max_log_len]
    logger.info("request %s: prompt %r, params %s", request_id, text,
                getattr(body, "model_dump_json", lambda **_: "")(exclude_defaults=True, exclude={"messages", "prompt"}))


def usage_of(ctx: ServingContext, output: RequestOutput) -> UsageInfo:
    """Usage so far; prompt_tokens_details only with --enable-prompt-tokens-details (as vLLM)."""
    cached = output.num_cached_tokens if ctx.config.prompt_tokens_details else None
    return UsageInfo.of(output.num_prompt_tokens, output.num_output_tokens, cached)


def total_usage(ctx: ServingContext, outputs: list[RequestOutput]) -> UsageInfo:
    """Usage of a request's choices (their latest outputs): the prompt once, every choice's tokens (vLLM)."""
    if len(outputs) == 1:
        return usage_of(ctx, outputs[0])
    cached = outputs[0].num_cached_tokens if ctx.config.prompt_tokens_details else None
    return UsageInfo.of(outputs[0].num_prompt_tokens, sum(o.num_output_tokens for o in outputs), cached)


def finish_reason_text(output: RequestOutput) -> str | None:
    """OpenAI's finish_reason: "stop" or "length" (an aborted request reports "abort", as vLLM)."""
    if output.finish_reason is None:
        return None
    if output.finish_reason in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT):
        return output.finish_reason.value
    return "stop"
