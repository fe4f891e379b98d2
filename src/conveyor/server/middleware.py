"""What wraps every route: the request id, the API key check, and CORS (vLLM's flags, default none).

Request id: the client's `X-Request-Id` (printable ASCII, at most 128 characters) or a new random one;
echoed on every response, used as the id of the engine request (prefixed, as vLLM: `cmpl-<id>`) and in
every log line about it. API key: a pure-ASGI check (as vLLM's AuthenticationMiddleware, constant time
over every configured key) on the routes that read or generate text; `/health`, `/ping`, `/version`,
`/metrics`, `/load` stay open for probes and scrapers. CORS: starlette's middleware with vLLM's flag
values; with no `--allowed-origins` no origin is allowed, so a browser page cannot read the answers.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import uuid

from fastapi import FastAPI
from starlette.datastructures import Headers, MutableHeaders
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from conveyor.server.errors import APIError, ErrorType, RejectReason, json_error_body
from conveyor.server.server_config import ServerConfig

REQUEST_ID_HEADER = "x-request-id"
_VALID_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")
GUARDED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/invocations", "/reset_prefix_cache",
                    "/step_log")
"""Routes that need the key when --api-key is set."""


def request_id_of(scope: Scope) -> str:
    """The request's id (set by RequestIdMiddleware; a fresh one outside it)."""
    state = scope.setdefault("state", {})
    if "request_id" not in state:
        state["request_id"] = uuid.uuid4().hex
    return str(state["request_id"])


class RequestIdMiddleware:
    """Takes (or makes) the request id and echoes it as `X-Request-Id` on the response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get(REQUEST_ID_HEADER)
        state = scope.setdefault("state", {})
        state["request_id"] = given if given and _VALID_REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        request_id = state["request_id"]

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)


class APIKeyMiddleware:
    """401 on a guarded route unless `Authorization: Bearer <key>` matches one of the keys."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...]) -> None:
        self.app = app
        self._digests = [hashlib.sha256(key.encode()).digest() for key in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" or not self._guarded(scope):
            await self.app(scope, receive, send)
            return
        if self._authorized(Headers(scope=scope).get("authorization", "")):
            await self.app(scope, receive, send)
            return
        error = unauthorized_error()
        body = json_error_body(error)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"www-authenticate", b"Bearer")]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        on_rejected = scope.get("app") and getattr(scope["app"].state, "on_unauthorized", None)
        if on_rejected is not None:
            on_rejected()

    @staticmethod
    def _guarded(scope: Scope) -> bool:
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        return path.startswith(GUARDED_PREFIXES)

    def _authorized(self, header: str) -> bool:
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()
        matched = False
        for expected in self._digests:  # every key compared, matched or not: constant time
            matched |= hmac.compare_digest(digest, expected)
        return matched


def unauthorized_error() -> APIError:
    return APIError(401, "missing or invalid API key: send the header `Authorization: Bearer <key>`",
                    ErrorType.AUTHENTICATION, reason=RejectReason.UNAUTHORIZED)


def add_middleware(app: FastAPI, config: ServerConfig) -> None:
    """Outermost first at request time: request id, then CORS, then the key check."""
    if config.api_keys:
        app.add_middleware(APIKeyMiddleware, keys=config.api_keys)
    app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                       allow_methods=list(config.allowed_methods), allow_headers=list(config.allowed_headers),
                       allow_credentials=config.allow_credentials, expose_headers=["X-Request-Id"])
    app.add_middleware(RequestIdMiddleware)
