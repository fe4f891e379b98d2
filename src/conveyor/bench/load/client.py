"""Streaming OpenAI client: one trace request in, one RequestRecord out, measured as `vllm bench serve` does.

Timing (docs/benchmarking.md): the clock starts just before the POST is issued. A "token chunk" is an
SSE event whose JSON has a non-empty `choices` list, whatever its text (vLLM counts chunks with empty
text too, e.g. a chat stream's first role-only delta). TTFT = first token chunk − send; ITL = gaps
between consecutive token chunks; E2E = last token chunk − send (the trailing usage chunk and [DONE] do
not move it). Output tokens come from the final `usage` object (we always ask for
stream_options.include_usage); a server that sends no usage gets the count of token chunks carrying
non-empty text instead. Outcomes: completed (a token chunk and then [DONE]), cancelled (the trace asked
to close the stream after a delay or after N chunks, and we did: the server sees a disconnect), or
failed with a kind: HTTP status, timeout, connection, or stream_error (stream broken before [DONE], no
token chunk, unparsable data, or an HTTP 200 stream carrying an `error` object, which vLLM sends when
it rejects a streaming request; a numeric error code maps to its HTTP kind).

The client's own cost per request caps what one load-generator process can offer: bodies are encoded
before the clock starts, SSE lines are parsed as bytes, and orjson replaces the stdlib json when it is
installed (`pip install 'conveyor[fast]'`); both paths give the same records.
"""

from __future__ import annotations

import asyncio
import enum
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from conveyor.bench.jsonvalue import Fields, JSONObject
from conveyor.bench.load.stream_chunk import StreamChunk, chunk_text
from conveyor.bench.trace.traces import TraceRequest


def _json_codec() -> tuple[Callable[[bytes], Any], Callable[[Any], bytes], str]:
    """(loads, dumps to bytes, library name): orjson's when installed, else the standard library's."""
    try:
        import orjson
    except ImportError:
        return json.loads, lambda obj: json.dumps(obj).encode(), "json"
    return orjson.loads, orjson.dumps, "orjson"


json_loads, json_dumps, JSON_LIBRARY = _json_codec()


class Endpoint(str, enum.Enum):
    COMPLETIONS = "completions"
    CHAT = "chat"

    @property
    def path(self) -> str:
        return "/v1/completions" if self is Endpoint.COMPLETIONS else "/v1/chat/completions"


class RequestStatus(str, enum.Enum):
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    FAILED = "failed"


class ErrorKind(str, enum.Enum):
    HTTP_4XX = "http_4xx"
    HTTP_5XX = "http_5xx"
    HTTP_503 = "http_503"
    TIMEOUT = "timeout"
    STREAM_ERROR = "stream_error"
    CONNECTION = "connection"

    @classmethod
    def from_status(cls, status: int) -> ErrorKind:
        if status == 503:
            return cls.HTTP_503
        return cls.HTTP_5XX if status >= 500 else cls.HTTP_4XX


@dataclass
class RequestRecord:
    """Everything measured about one request (a line of requests.jsonl). Times in seconds."""

    request_id: str
    """The trace's request id."""
    request_class: str
    """The trace's class."""
    scheduled_s: float
    """When it was due (arrival process; a later session turn: previous answer + think time), from the run start."""
    sent_s: float = 0.0
    """When the POST was actually issued, from the run start."""
    client_queue_s: float = 0.0
    """Time spent waiting for a --max-concurrency slot after scheduled_s (vLLM's client_queue_time)."""
    send_lag_s: float = 0.0
    """sent_s − scheduled_s − client_queue_s: how far the client itself fell behind."""
    status: RequestStatus = RequestStatus.FAILED
    """completed / cancelled / failed."""
    error_kind: ErrorKind | None = None
    """Why it failed (None unless failed)."""
    http_status: int | None = None
    """HTTP status of the response, if one came."""
    error_message: str | None = None
    """Server or client error text, truncated."""
    prompt_tokens: int = 0
    """usage.prompt_tokens, else the trace's prompt_len."""
    output_tokens: int = 0
    """usage.completion_tokens, else the number of non-empty token chunks."""
    ttft_s: float | None = None
    """First token chunk − send."""
    itl_s: list[float] = field(default_factory=list)
    """Gaps between consecutive token chunks."""
    e2e_s: float | None = None
    """Last token chunk − send (completed requests)."""
    tpot_s: float | None = None
    """(e2e − ttft) / (output_tokens − 1), when output_tokens > 1."""
    end_s: float | None = None
    """When the request ended (any outcome), from the run start."""
    session_id: str | None = None
    """The trace's session id, for session turns."""
    turn: int | None = None
    """Turn index within the session."""
    worker: int = 0
    """The load-generator process that sent it (--workers)."""
    in_window: bool = True
    """Sent inside the steady-state window (after warm-up, before cool-down), so counted in the summary."""
    cached_tokens: int | None = None
    """usage.prompt_tokens_details.cached_tokens: prompt tokens the server's prefix cache served (None: not
    reported; vLLM and conveyor report it with --enable-prompt-tokens-details)."""

    def to_json(self) -> JSONObject:
        out: JSONObject = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["status"] = self.status.value
        out["error_kind"] = None if self.error_kind is None else self.error_kind.value
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RequestRecord:
        """The inverse of to_json (records come back from worker processes this way)."""
        kind = Fields.of(data, "worker record").opt_text("error_kind")
        return cls(**dict(data, status=RequestStatus(data["status"]),
                          error_kind=None if kind is None else ErrorKind(kind)))


@dataclass(frozen=True)
class ClientConfig:
    """Where and how to send."""

    base_url: str
    """Server root, e.g. http://127.0.0.1:8000."""
    model: str
    """The `model` field of every request."""
    endpoint: Endpoint = Endpoint.COMPLETIONS
    """completions or chat."""
    api_key: str | None = None
    """Bearer token, if the server wants one."""
    request_timeout_s: float = 600.0
    """Give up on a request (kind timeout) after this long."""
    temperature: float | None = None
    """The `temperature` of every request (None: not sent, the server's default)."""
    cache_salt: str | None = None
    """vLLM's `cache_salt` of every request: one per run, so a run never hits blocks an earlier run left in
    the prefix cache while its own requests still share among themselves (None: not sent)."""


def build_payload(cfg: ClientConfig, req: TraceRequest) -> dict[str, object]:
    payload: dict[str, object] = {"model": cfg.model, "stream": True, "stream_options": {"include_usage": True}}
    if cfg.endpoint is Endpoint.CHAT:
        if req.prompt_token_ids is not None:
            raise ValueError(f"request {req.request_id}: prompt_token_ids cannot be sent to --endpoint chat")
        payload["messages"] = req.messages if req.messages is not None else [{"role": "user", "content": req.prompt}]
        payload["max_completion_tokens"] = req.output_len
    else:
        if req.messages is not None:
            payload["prompt"] = "\n".join(f"{m['role']}: {m['content']}" for m in req.messages)
        else:
            payload["prompt"] = req.prompt if req.prompt is not None else req.prompt_token_ids
        payload["max_tokens"] = req.output_len
    if req.ignore_eos:
        payload["ignore_eos"] = True
    if cfg.temperature is not None:
        payload["temperature"] = cfg.temperature
    if cfg.cache_salt is not None:
        payload["cache_salt"] = cfg.cache_salt
    return payload


REQUEST_ID_HEADER = "x-request-id"
"""Carries the trace's request id: the server logs it, and the retry middleware counts retries by it."""


def build_headers(cfg: ClientConfig, req: TraceRequest) -> dict[str, str]:
    headers = {"Content-Type": "application/json", REQUEST_ID_HEADER: req.request_id}
    if cfg.api_key:
        headers["Authorization"] = f"Bearer {cfg.api_key}"
    return headers


@dataclass(frozen=True)
class PreparedRequest:
    """A trace request with its HTTP body already encoded (done before the run, off the hot path)."""

    req: TraceRequest
    """The trace request."""
    url: str
    """Full endpoint URL."""
    body: bytes
    """JSON payload."""
    headers: dict[str, str]
    """Request headers."""


def prepare(cfg: ClientConfig, req: TraceRequest) -> PreparedRequest:
    return PreparedRequest(req=req, url=cfg.base_url.rstrip("/") + cfg.endpoint.path,
                           body=json_dumps(build_payload(cfg, req)), headers=build_headers(cfg, req))


@dataclass(frozen=True)
class SendContext:
    """What every send of one load generator shares."""

    session: aiohttp.ClientSession
    """The HTTP session (one connection pool)."""
    cfg: ClientConfig
    """Where and how to send."""
    t0: float
    """perf_counter() at the run start; every *_s of a record is relative to it."""


class _Cancel(Exception):
    """Raised inside the stream reader when the trace's cancel_after_tokens is reached."""


@dataclass
class _Stream:
    """Running state of one streamed response."""

    t_send: float
    answer: list[str] | None
    """Collects the streamed text when the caller needs it (a session's history), else None."""
    last_token_t: float | None = None
    num_text_chunks: int = 0
    num_token_chunks: int = 0
    usage: object = None
    """The last non-empty `usage` the stream carried (read by _count_tokens, off the per-token path)."""
    done: bool = False


def _on_event(data: bytes, st: _Stream, rec: RequestRecord, cancel_after_tokens: int | None) -> None:
    """Handle one SSE `data:` payload (stripped bytes); raises _Cancel or ValueError (stream error)."""
    if data == b"[DONE]":
        st.done = True
        return
    now = time.perf_counter()
    obj: StreamChunk = json_loads(data)
    if not isinstance(obj, dict):
        raise ValueError(f"SSE data is not a JSON object: {data[:200]!r}")
    if obj.get("error") is not None:
        raise _StreamErrorObject(obj["error"])
    choices = obj.get("choices")
    if choices:
        if st.last_token_t is None:
            rec.ttft_s = now - st.t_send
        else:
            rec.itl_s.append(now - st.last_token_t)
        st.last_token_t = now
        st.num_token_chunks += 1
        text = chunk_text(choices[0])
        if text:
            st.num_text_chunks += 1
            if st.answer is not None:
                st.answer.append(text)
        if cancel_after_tokens is not None and st.num_token_chunks >= cancel_after_tokens:
            raise _Cancel()
    usage = obj.get("usage")
    if usage:
        st.usage = usage


class _StreamErrorObject(Exception):
    def __init__(self, error: object) -> None:
        super().__init__(json.dumps(error)[:500] if not isinstance(error, str) else error[:500])
        code = Fields.of(error, "stream error").raw("code") if isinstance(error, dict) else None
        # vLLM's numeric `code` is the HTTP status it would have answered; anything else is no status.
        self.code = code if isinstance(code, int) and 400 <= code < 600 else None


async def _read_stream(resp: aiohttp.ClientResponse, st: _Stream, rec: RequestRecord,
                       cancel_after_tokens: int | None) -> None:
    pending = b""
    async for data in resp.content.iter_any():  # whatever arrived: fewer awaits than line by line
        lines = (pending + data).split(b"\n")
        pending = lines.pop()  # an incomplete last line waits for the next read
        for raw in lines:
            if not st.done and raw.startswith(b"data:"):  # skips blanks, SSE comments (pings), event:/id:
                _on_event(raw[5:].strip(), st, rec, cancel_after_tokens)
    if pending.startswith(b"data:") and not st.done:
        _on_event(pending[5:].strip(), st, rec, cancel_after_tokens)
    # Reading on to the end of the body (not stopping at [DONE]) lets aiohttp reuse the connection.


async def _exchange(session: aiohttp.ClientSession, prepared: PreparedRequest, st: _Stream,
                    rec: RequestRecord) -> None:
    async with session.post(prepared.url, data=prepared.body, headers=prepared.headers) as resp:
        rec.http_status = resp.status
        if resp.status != 200:
            rec.error_kind = ErrorKind.from_status(resp.status)
            rec.error_message = (await resp.text(errors="replace"))[:500]
            return
        try:
            await _read_stream(resp, st, rec, prepared.req.cancel_after_tokens)
        except _Cancel:
            resp.close()  # drop the connection: the server sees the client go away and aborts
            raise


def _fail(rec: RequestRecord, kind: ErrorKind, message: str) -> None:
    rec.status, rec.error_kind, rec.error_message = RequestStatus.FAILED, kind, message[:500]


async def send_request(ctx: SendContext, prepared: PreparedRequest, rec: RequestRecord,
                       answer: list[str] | None = None) -> RequestRecord:
    """Send one request and fill rec (and `answer`, when given, with the streamed text pieces); never
    raises for anything the server or network does."""
    req, cfg = prepared.req, ctx.cfg
    cancel_s = req.cancel_after_s
    limit_s = cfg.request_timeout_s if cancel_s is None else min(cancel_s, cfg.request_timeout_s)
    st = _Stream(t_send=time.perf_counter(), answer=answer)
    rec.sent_s = st.t_send - ctx.t0
    rec.send_lag_s = rec.sent_s - rec.scheduled_s - rec.client_queue_s
    try:
        await asyncio.wait_for(_exchange(ctx.session, prepared, st, rec), limit_s)
    except _Cancel:
        rec.status = RequestStatus.CANCELLED
    except asyncio.TimeoutError:
        if cancel_s is not None and cancel_s <= cfg.request_timeout_s:
            rec.status = RequestStatus.CANCELLED
        else:
            _fail(rec, ErrorKind.TIMEOUT, f"no complete response within {cfg.request_timeout_s} s")
    except _StreamErrorObject as exc:
        _fail(rec, ErrorKind.STREAM_ERROR if exc.code is None else ErrorKind.from_status(exc.code), str(exc))
    except (aiohttp.ClientPayloadError, ValueError) as exc:
        _fail(rec, ErrorKind.STREAM_ERROR, f"broken stream: {exc!r}")
    except aiohttp.ClientError as exc:
        broken = rec.http_status == 200
        _fail(rec, ErrorKind.STREAM_ERROR if broken else ErrorKind.CONNECTION, repr(exc))
    else:
        _finish(rec, st)
    _count_tokens(rec, st, req)
    rec.end_s = time.perf_counter() - ctx.t0
    return rec


def _finish(rec: RequestRecord, st: _Stream) -> None:
    """The exchange returned normally: completed, or failed by HTTP status or an incomplete stream."""
    if rec.error_kind is not None:
        rec.status = RequestStatus.FAILED
    elif not st.done:
        _fail(rec, ErrorKind.STREAM_ERROR, "stream ended before data: [DONE]")
    elif st.last_token_t is None:
        _fail(rec, ErrorKind.STREAM_ERROR, "stream carried no token chunk")
    else:
        rec.status = RequestStatus.COMPLETED
        rec.e2e_s = st.last_token_t - st.t_send


def _usage_count(usage: object, key: str) -> int | None:
    """An integer count of the server's usage object (None when it sent none)."""
    value = usage.get(key) if isinstance(usage, dict) else None
    return int(value) if isinstance(value, int) else None


def _count_tokens(rec: RequestRecord, st: _Stream, req: TraceRequest) -> None:
    completion = _usage_count(st.usage, "completion_tokens")
    rec.output_tokens = st.num_text_chunks if completion is None else completion
    prompt = _usage_count(st.usage, "prompt_tokens")
    rec.prompt_tokens = req.prompt_len if prompt is None else prompt
    details = Fields.of(st.usage, "usage").raw("prompt_tokens_details") if isinstance(st.usage, dict) else None
    rec.cached_tokens = _usage_count(details, "cached_tokens")
    if rec.status is RequestStatus.COMPLETED and rec.output_tokens > 1 and rec.e2e_s is not None:
        rec.tpot_s = (rec.e2e_s - (rec.ttft_s or 0.0)) / (rec.output_tokens - 1)
