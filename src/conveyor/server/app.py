"""The OpenAI-compatible HTTP application: routes, request parsing, auth and the error contract.

`build_app(engine, server_config)` wires an `EngineClient` (the real AsyncEngineClient or a test fake) to
FastAPI. Bodies are read and parsed here rather than by FastAPI, so that every failure (too large,
not UTF-8, not JSON, wrong types) is a 4xx carrying OpenAI's error object that names the problem;
FastAPI's own 422 is turned into a 400 as vLLM does. The app never owns the engine: whoever built
the engine shuts it down.

Error contract (body always `{"error": {"message", "type", "param", "code"}}`):

| status | when |
|---|---|
| 400 | bad JSON or UTF-8, wrong types, bad or unsupported fields, prompt (+ max_tokens) > max_model_len |
| 401 | `--api-key` set and `Authorization: Bearer <key>` missing or wrong (/v1/* only) |
| 404 | unknown `model` ("The model `x` does not exist."), unknown route |
| 413 | body over `ServerConfig.max_request_body_bytes` |
| 409 | POST /reset_prefix_cache refused: requests hold KV blocks (`param`: reset_running_requests) |
| 404 | GET /step_log while the step log is off (`--step-log-size` 0) |
| 503 + Retry-After | in-flight cap (--max-num-queued-reqs) or prefill-token cap (--max-num-queued-tokens) reached; queue timeout (--queue-timeout, `timeout_error`), also for `stream: true` |
| 503 | draining after SIGTERM; engine dead (also /health) |
| 500 | the engine failed while running the request |

No 200 is sent before the request's first output. Once a stream has started, a failure is one
`data: {"error": {...}}` event, then the stream closes without `[DONE]`; an abort at the end of the
shutdown grace is a normal end (`finish_reason: "abort"`, then `[DONE]`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from conveyor import __version__
from conveyor.server.server_config import ServerConfig
from conveyor.engine.generation_defaults import NO_SAMPLING_DEFAULTS, SamplingDefaults
from conveyor.engine.types import EngineClient
from conveyor.server.context import ServingContext
from conveyor.server.errors import APIError, ErrorType, RejectReason, bad_request, from_error_details
from conveyor.server.generation import ClientDisconnected
from conveyor.server.lifecycle import AdmissionGate
from conveyor.server.metrics import ServerMetrics
from conveyor.server.middleware import add_middleware, request_id_of
from conveyor.server.request_body import BodyLimits, parse_body, read_json_object, validate_body
from conveyor.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from conveyor.server.responses import DetokenizeResponse, ModelCard, ModelList, TokenizeResponse
from conveyor.server.openapi import add_openapi_route
from conveyor.server.serving_chat import create_chat_completion, render_chat_prompt
from conveyor.server.serving_completion import create_completion

logger = logging.getLogger(__name__)
CLIENT_CLOSED_REQUEST = 499
"""nginx's status for "the client went away before the response": nobody reads it, logs do."""


def build_app(engine: EngineClient, server_config: ServerConfig, metrics_dir: str | None = None,
              sampling_defaults: SamplingDefaults = NO_SAMPLING_DEFAULTS) -> FastAPI:
    """The FastAPI app serving `engine`; its state (`app.state.ctx`) holds the gate and metrics.
    `metrics_dir`: prometheus_client's multiprocess directory when several front ends share /metrics;
    `sampling_defaults`: the model's defaults for request fields left unset (--generation-config)."""
    info = engine.info
    metrics = ServerMetrics(info, metrics_dir)
    metrics.start()
    engine.add_stats_listener(metrics.on_step)
    gate = AdmissionGate()
    engine.add_dead_listener(gate.mark_engine_dead)
    ctx = ServingContext(engine=engine, model_name=info.model_name, max_model_len=info.max_model_len,
                         gate=gate, metrics=metrics, config=server_config, sampling_defaults=sampling_defaults)
    app = FastAPI(title="conveyor", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ctx = ctx
    app.state.server_config = server_config
    app.state.on_unauthorized = lambda: metrics.count_rejection(RejectReason.UNAUTHORIZED)
    add_middleware(app, server_config)
    _add_error_handlers(app, ctx)
    _add_generation_routes(app, ctx, server_config)
    _add_admin_routes(app, ctx, server_config)
    add_openapi_route(app)
    return app


def _add_generation_routes(app: FastAPI, ctx: ServingContext, config: ServerConfig) -> None:
    limit = BodyLimits(config.max_request_body_bytes, config.body_timeout_s)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        ctx.gate.check_open()
        return await _completion(ctx, await parse_body(request, CompletionRequest, limit), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        ctx.gate.check_open()
        return await _chat(ctx, await parse_body(request, ChatCompletionRequest, limit), request)

    @app.post("/invocations")
    async def invocations(request: Request) -> Response:
        """SageMaker's route (vLLM's): a chat body (`messages`) or a completions body (`prompt`)."""
        ctx.gate.check_open()
        value = await read_json_object(request, limit)
        if "messages" in value:
            return await _chat(ctx, validate_body(value, ChatCompletionRequest), request)
        if "prompt" in value:
            return await _completion(ctx, validate_body(value, CompletionRequest), request)
        raise bad_request("invocations: the body needs `messages` (chat) or `prompt` (completions)", "prompt")

    @app.get("/v1/models")
    async def models() -> Response:
        card = ModelCard(id=ctx.model_name, created=int(time.time()), root=ctx.model_name,
                         max_model_len=ctx.max_model_len)
        return Response(ModelList(data=[card]).model_dump_json(), media_type="application/json")


async def _completion(ctx: ServingContext, body: CompletionRequest, request: Request) -> Response:
    ctx.check_model(body.model)
    return await create_completion(ctx, body, request)


async def _chat(ctx: ServingContext, body: ChatCompletionRequest, request: Request) -> Response:
    ctx.check_model(body.model)
    return await create_chat_completion(ctx, body, request)


def _add_admin_routes(app: FastAPI, ctx: ServingContext, config: ServerConfig) -> None:
    _add_probe_routes(app, ctx, config.health_check_timeout_s)
    _add_engine_control_routes(app, ctx)
    _add_tokenizer_routes(app, ctx, BodyLimits(config.max_request_body_bytes, config.body_timeout_s))


def _add_probe_routes(app: FastAPI, ctx: ServingContext, timeout_s: float) -> None:
    """What load balancers, orchestrators and scrapers poll: health, load, version, metrics."""

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if await _is_healthy(ctx, timeout_s) else 503)

    async def ping() -> Response:
        """SageMaker's health check (vLLM's): the same answer as /health."""
        return Response(status_code=200 if await _is_healthy(ctx, timeout_s) else 503)

    for method in ("GET", "POST"):  # one route each: an OpenAPI operation id is per method
        app.add_api_route("/ping", ping, methods=[method], operation_id=f"ping_{method.lower()}")

    @app.get("/load")
    async def load() -> JSONResponse:
        """vLLM's server-load probe: the generation requests this server has in flight."""
        return JSONResponse({"server_load": ctx.gate.num_in_flight})

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _add_engine_control_routes(app: FastAPI, ctx: ServingContext) -> None:
    """Calls into the engine core that benchmarks make between and during runs."""

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> Response:
        """vLLM's (always exposed here): forget the engine core's prefix cache, e.g. between benchmark runs.
        Refused while requests hold KV blocks unless ?reset_running_requests=true preempts them; vLLM then
        answers 200 all the same, conveyor 409 so that a caller never believes in a reset that did not
        happen. ?reset_external is accepted: no external (connector) cache exists to reset."""
        force = _query_flag(request, "reset_running_requests")
        _query_flag(request, "reset_external")
        if not await ctx.engine.reset_prefix_cache(force):
            raise APIError(409, "reset_running_requests: the prefix cache was not reset, requests hold KV "
                                "blocks; retry when idle or pass reset_running_requests=true to preempt them",
                           param="reset_running_requests", reason=None)
        return Response(status_code=200)

    @app.get("/step_log")
    async def step_log() -> Response:
        """conveyor's: the engine's step records since the last call (one JSON object a line, oldest first),
        then forgotten, so a benchmark collects each step once; 404 while --step-log-size is 0."""
        records = await ctx.engine.drain_step_log()
        if records is None:
            raise APIError(404, "the step log is off: start the server with --step-log-size N", ErrorType.NOT_FOUND,
                           reason=None)

        def lines() -> str:
            return "".join(json.dumps(record.to_json()) + "\n" for record in records)

        # A full ring (say 100 000 steps) takes a while to serialize: off the event loop, streams keep going.
        return Response(lines() if len(records) < 4096 else await asyncio.to_thread(lines),
                        media_type="application/x-ndjson")


def _add_tokenizer_routes(app: FastAPI, ctx: ServingContext, limit: BodyLimits) -> None:
    """vLLM's /tokenize and /detokenize, with the model's own tokenizer and chat template."""

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = await parse_body(request, TokenizeRequest, limit)
        ctx.check_model(body.model)
        body.check_supported()
        if body.prompt is not None:
            tokens = await ctx.engine.tokenize(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            chat = validate_body({"messages": body.messages, "add_generation_prompt": body.add_generation_prompt},
                                 ChatCompletionRequest)
            tokens = await render_chat_prompt(ctx, chat)
        return Response(await _tokenize_reply(tokens, ctx.max_model_len), media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body = await parse_body(request, DetokenizeRequest, limit)
        ctx.check_model(body.model)
        _check_in_vocabulary(body.tokens, ctx.engine.info.vocab_size)
        try:
            text = await ctx.engine.detokenize(body.tokens)
        except Exception as error:  # the tokenizer's own error type for ids outside its vocabulary
            raise bad_request(f"tokens: cannot detokenize: {error}", "tokens") from None
        return Response(DetokenizeResponse(prompt=text).model_dump_json(), media_type="application/json")


def _check_in_vocabulary(tokens: list[int], vocab_size: int) -> None:
    """As vLLM: an id outside the vocabulary is a 400 naming `tokens`, not "" for it."""
    bad = next((token for token in tokens if not 0 <= token < vocab_size), None)
    if bad is not None:
        raise bad_request(f"tokens: token id {bad} is out of range [0, {vocab_size})", "tokens")


async def _tokenize_reply(tokens: list[int], max_model_len: int) -> str:
    """The /tokenize body; for a long prompt (a million ids) built and serialized on a worker thread."""
    def build() -> str:
        return TokenizeResponse(count=len(tokens), max_model_len=max_model_len, tokens=tokens).model_dump_json()

    return build() if len(tokens) < 65536 else await asyncio.to_thread(build)


async def _is_healthy(ctx: ServingContext, timeout_s: float) -> bool:
    """Not draining, and the engine core alive and answering: a core whose process exists but is
    stopped or stuck looked healthy while every request hung."""
    if not ctx.engine.is_running:
        ctx.gate.engine_dead = True
    if ctx.gate.draining or ctx.gate.engine_dead:
        return False
    if await ctx.engine.check_health(timeout_s):
        return True
    logger.warning("/health: the engine core did not answer within %g s (--health-check-timeout): its loop is "
                   "stopped or stuck in a step; %d request(s) in flight", timeout_s, ctx.gate.num_in_flight)
    return False


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _query_flag(request: Request, name: str) -> bool:
    """A boolean query parameter spelled as FastAPI's bool (vLLM's routes) accepts; else a 400 naming it."""
    value = request.query_params.get(name, "false").lower()
    if value not in _TRUE + _FALSE:
        raise bad_request(f"{name}: must be a boolean (true or false), got {value!r}", name)
    return value in _TRUE


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.to_response().model_dump(), status_code=error.status_code, headers=error.headers)


def _add_error_handlers(app: FastAPI, ctx: ServingContext) -> None:
    @app.exception_handler(APIError)
    async def on_api_error(_: Request, error: APIError) -> JSONResponse:
        if error.reason is not None:
            ctx.metrics.count_rejection(error.reason)
        return _error_response(error)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        ctx.metrics.count_rejection(RejectReason.INVALID_REQUEST)
        details = error.errors()
        return _error_response(from_error_details(details[0]) if details else bad_request("invalid request"))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = ErrorType.NOT_FOUND if error.status_code == 404 else ErrorType.INVALID_REQUEST
        message = f"{request.method} {request.url.path}: {error.detail}"
        return _error_response(APIError(error.status_code, message, kind, reason=None,
                                        headers=dict(error.headers or {})))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, error: Exception) -> JSONResponse:
        # The details stay in the log, under the request id the client got back; never in the body.
        request_id = request_id_of(request.scope)
        logger.error("request %s: unhandled error serving %s %s", request_id, request.method, request.url.path,
                     exc_info=error)
        return _error_response(APIError(500, f"internal server error (request id {request_id}); "
                                             "the server log has the details", ErrorType.INTERNAL, reason=None))

    @app.exception_handler(ClientDisconnected)
    async def on_disconnect(request: Request, __: ClientDisconnected) -> Response:
        logger.info("request %s: the client disconnected before the response (%s %s)",
                    request_id_of(request.scope), request.method, request.url.path)
        return Response(status_code=CLIENT_CLOSED_REQUEST)
