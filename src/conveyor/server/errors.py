"""OpenAI's error object and the one exception the server raises to produce it.

Every failure a client can see goes through `APIError`: it carries the HTTP status, the OpenAI
`type`, the offending `param` (the request field, when one is to blame), extra headers such as
`Retry-After`, and the reason it is counted under in `conveyor:requests_rejected_total`.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field

from pydantic import BaseModel, ValidationError


class ErrorType(enum.Enum):
    """OpenAI's error `type` strings."""

    INVALID_REQUEST = "invalid_request_error"
    AUTHENTICATION = "authentication_error"
    NOT_FOUND = "not_found_error"
    OVERLOADED = "service_unavailable_error"
    TIMEOUT = "timeout_error"
    INTERNAL = "internal_server_error"


class RejectReason(enum.Enum):
    """Label values of `conveyor:requests_rejected_total{reason}`."""

    INVALID_REQUEST = "invalid_request"
    """Malformed body, wrong types, unsupported or out-of-range fields (400, 404, 413)."""
    ENGINE_REJECTED = "engine_rejected"
    """The engine refused it, e.g. prompt + max_tokens over max_model_len (400)."""
    MAX_NUM_QUEUED_REQS = "max_num_queued_reqs"
    """In-flight requests (waiting + running) were at --max-num-queued-reqs (503)."""
    MAX_NUM_QUEUED_TOKENS = "max_num_queued_tokens"
    """Prompt tokens still in prefill were at --max-num-queued-tokens (503)."""
    SHUTTING_DOWN = "shutting_down"
    """Received after SIGTERM, while draining (503)."""
    UNAUTHORIZED = "unauthorized"
    """Missing or wrong API key (401)."""
    ENGINE_DEAD = "engine_dead"
    """The engine core has died or stopped (503)."""


class ErrorInfo(BaseModel):
    """The inner object of OpenAI's error response."""

    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorResponse(BaseModel):
    """`{"error": {...}}`, as OpenAI sends it."""

    error: ErrorInfo


@dataclass
class APIError(Exception):
    """A failure to report to the client as an OpenAI error object."""

    status_code: int
    message: str
    error_type: ErrorType = ErrorType.INVALID_REQUEST
    param: str | None = None
    reason: RejectReason | None = RejectReason.INVALID_REQUEST
    """Counted under this rejection reason (None: not a rejection, e.g. a mid-stream failure)."""
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # A lone surrogate quoted from the request cannot be encoded as UTF-8: escape it (never a 500).
        self.message = _printable(self.message)
        self.param = None if self.param is None else _printable(self.param)
        super().__init__(self.message)

    def to_response(self) -> ErrorResponse:
        info = ErrorInfo(message=self.message, type=self.error_type.value, param=self.param,
                         code=self.status_code)
        return ErrorResponse(error=info)

    def to_sse(self) -> str:
        """The error as one server-sent event (for failures after the stream has started)."""
        return f"data: {self.to_response().model_dump_json()}\n\n"


def _printable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def from_validation_error(error: ValidationError) -> APIError:
    """The first pydantic error, as a 400 naming the field path (e.g. `messages.0.role`)."""
    first = error.errors(include_url=False)[0]
    return from_error_details(first)


def from_error_details(details: dict) -> APIError:
    """One pydantic/FastAPI error dict -> 400. The location drops FastAPI's leading `body`."""
    loc = [str(part) for part in details.get("loc", ()) if _is_field_part(part)]
    param = ".".join(loc) or None
    message = str(details.get("msg", "invalid request")).removeprefix("Value error, ")
    if details.get("type") == "extra_forbidden":
        message = "unknown field (conveyor refuses fields it does not know rather than ignore them)"
    text = f"{param}: {message}" if param else message
    return bad_request(text, param)


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _is_field_part(part: object) -> bool:
    """True for field names and list indexes; False for FastAPI's `body` and pydantic's union tags
    such as `str`, `list[int]` or `function-after[...]`."""
    if isinstance(part, int):
        return True
    text = str(part)
    return text != "body" and text not in _TYPE_TAGS and not any(c in text for c in "[-") and not text[:1].isupper()


def from_value_error(error: ValueError, known_fields: set[str]) -> APIError:
    """A `SamplingParams` ValueError (its message starts with the field name) -> 400 naming it."""
    message = str(error)
    first_word = message.split(" ", 1)[0]
    return bad_request(message, first_word if first_word in known_fields else None)


def json_error_body(error: APIError) -> bytes:
    return json.dumps(error.to_response().model_dump()).encode()
