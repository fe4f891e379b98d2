"""Reading a request body into a validated model, with a 4xx naming the problem for every way it can fail.

Order: the media type must be `application/json` (415 otherwise: a `text/plain` POST is a "simple"
cross-origin request a web page can send without a CORS preflight, so accepting it would let any page a
local user opens drive an unauthenticated server); the size limit (413); UTF-8 (400); JSON, without
NaN/Infinity literals (400); an object (400); no lone UTF-16 surrogate in any string (`"\\ud800"` is
valid JSON but no text: 400 naming the field, before the tokenizer sees it); then the pydantic model
(400 naming the field). A client that goes away mid-body is `ClientDisconnected` (one log line). A body
that has not arrived whole within `--body-timeout` seconds of the handler's first read is a 408: a body
shorter than its Content-Length, or one sent a byte a second, would otherwise hold its connection (and a
slot under --limit-concurrency) for as long as the client likes.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from conveyor.server.errors import APIError, bad_request, from_validation_error
from conveyor.server.generation import ClientDisconnected

BodyT = TypeVar("BodyT", bound=BaseModel)
UNSUPPORTED_MEDIA_TYPE = 415
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
"""A JSON escape of a UTF-16 surrogate: the only way a lone surrogate can reach a decoded body."""


def check_media_type(request: Request) -> None:
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        shown = media_type or "none"
        raise APIError(UNSUPPORTED_MEDIA_TYPE, f"Content-Type must be application/json (got {shown})")


REQUEST_TIMEOUT = 408


@dataclass(frozen=True)
class BodyLimits:
    """How large a request body may be, and how long it may take to arrive."""

    max_bytes: int
    """Largest accepted body (413 beyond)."""
    timeout_s: float
    """Time for the whole body to arrive (408 beyond)."""


async def _read_chunks(request: Request, max_bytes: int) -> bytes:
    too_large = APIError(413, f"request body is larger than the server's limit of {max_bytes} bytes")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def read_body(request: Request, limits: BodyLimits) -> bytes:
    try:
        return await asyncio.wait_for(_read_chunks(request, limits.max_bytes), limits.timeout_s)
    except ClientDisconnect:
        raise ClientDisconnected() from None
    except asyncio.TimeoutError:  # asyncio.wait_for raises this alias of TimeoutError on Python 3.10 too
        raise APIError(REQUEST_TIMEOUT, f"the request body did not arrive whole within {limits.timeout_s:g} s "
                                        "(--body-timeout)") from None


async def read_json_object(request: Request, limits: BodyLimits) -> dict[str, object]:
    """The body as a JSON object (see the module docstring for every refusal)."""
    check_media_type(request)
    body = await read_body(request, limits)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise bad_request(f"request body is not valid UTF-8 (invalid byte at offset {error.start})") from None
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as error:  # JSONDecodeError is a ValueError; RecursionError: nesting
        raise bad_request(f"request body is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise bad_request(f"request body must be a JSON object, not {type(value).__name__}")
    if _SURROGATE_ESCAPE.search(body):
        path = surrogate_path(value)
        if path is not None:
            raise bad_request(f"{path}: contains a lone UTF-16 surrogate (not valid Unicode text)", path)
    return value


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a valid JSON number")


def surrogate_path(value: object, path: str = "") -> str | None:
    """The dotted path of the first string (or key) holding a lone surrogate, else None."""
    if isinstance(value, str):
        return path or "body" if not _encodable(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if not _encodable(str(key)):
                return where
            found = surrogate_path(item, where)
            if found is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            if isinstance(item, (str, dict, list)):
                found = surrogate_path(item, f"{path}.{index}" if path else str(index))
                if found is not None:
                    return found
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


async def parse_body(request: Request, model: type[BodyT], limits: BodyLimits) -> BodyT:
    value = await read_json_object(request, limits)
    body = validate_body(value, model)
    # A megabyte body is ~7 ms to parse and as much again for the handler to turn into sampling
    # parameters; a turn of the loop between the two lets every stream's next chunk out in between.
    await asyncio.sleep(0)
    return body


def validate_body(value: dict[str, object], model: type[BodyT]) -> BodyT:
    try:
        return model.model_validate(value)
    except ValidationError as error:
        raise from_validation_error(error) from None
