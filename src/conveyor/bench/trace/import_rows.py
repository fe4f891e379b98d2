"""The importer's input record, and conveyor's own request log read into it.

Every input format is parsed once, at the edge, into ImportedRow: conveyor's JSONL request log here
(`log_rows`), other tools' files in trace_readers.py. The row's fields are checked when it is made, and
errors name the file and line (or row) and the field, so the importer (trace_import.py) works on typed
records only and every format keeps the same anonymizing guarantees.
"""

from __future__ import annotations

import datetime as dt
import json
import pathlib
from collections.abc import Iterator
from dataclasses import dataclass

from conveyor.bench.jsonvalue import JSON, Fields, JSONObject
from conveyor.bench.trace.traces import TraceError

ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
OUTPUT_KEYS = ("output_tokens", "completion_tokens", "output_len")


@dataclass(frozen=True)
class ChatMessage:
    """One message of an imported chat request."""

    role: str
    """One of ROLES (another role in the file is read as `user`)."""
    content: str
    """The message text."""

    def as_dict(self) -> dict[str, str]:
        """The trace's form of a message."""
        return {"role": self.role, "content": self.content}


def chat_message(role: str | None, content: str) -> ChatMessage:
    """A message whose role is kept only when it is a known one."""
    return ChatMessage(role=role if role in ROLES else "user", content=content)


@dataclass(frozen=True, kw_only=True)
class ImportedRow:
    """One request read from an input file, its fields checked."""

    where: str
    """file:line or file row N (message M): what errors name."""
    output_tokens: int
    """Output tokens to ask for, >= 1."""
    prompt: str | None = None
    """Plain-text prompt; exactly one of prompt / messages is set."""
    messages: tuple[ChatMessage, ...] | None = None
    """Chat messages, at least one."""
    timestamp_s: float | None = None
    """Arrival in seconds from any origin (None: the row has no time)."""
    request_class: str | None = None
    """The row's class (None: the import's default class)."""
    session_id: str | None = None
    """The row's session or user."""
    turn: int | None = None
    """Turn index within session_id."""
    prompt_tokens: int | None = None
    """Logged prompt length in tokens, >= 0 (else the prompt's word count)."""
    request_id: str | None = None
    """Logged request id (None: the importer numbers the request)."""

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None) or self.messages == ():
            raise TraceError(f"{self.where}: needs a string 'prompt' or a non-empty 'messages' list")
        if self.turn is not None and self.session_id is None:
            raise TraceError(f"{self.where}: turn must be an integer and needs a session_id")
        if self.output_tokens < 1:
            raise TraceError(f"{self.where}: needs an output token count >= 1 ({' | '.join(OUTPUT_KEYS)})")

    @property
    def text(self) -> str:
        """The prompt, or the messages' contents joined by spaces."""
        return self.prompt if self.prompt is not None else " ".join(m.content for m in self.messages or ())


def timestamp_s(value: JSON, where: str) -> float:
    """Seconds, or an ISO-8601 time."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            pass
    raise TraceError(f"{where}: timestamp must be seconds or ISO-8601, got {value!r}")


def str_field(row: JSONObject, key: str) -> str | None:
    """row[key] when it is a string."""
    value = row.get(key)
    return value if isinstance(value, str) else None


def int_field(row: JSONObject, key: str) -> int | None:
    """row[key] when it is an integer."""
    value = row.get(key)
    return value if isinstance(value, int) else None


def list_field(row: JSONObject, key: str) -> list[JSON] | None:
    """row[key] when it is a list."""
    value = row.get(key)
    return value if isinstance(value, list) else None


def object_field(row: JSONObject, key: str) -> JSONObject:
    """row[key] when it is an object, else an empty one (a log line without a response, a response without usage)."""
    value = row.get(key)
    return value if isinstance(value, dict) else {}


def first_value(row: JSONObject, keys: tuple[str, ...], default: JSON) -> JSON:
    """The value of the first of keys the row has (a null too), else default."""
    return next((row[k] for k in keys if k in row), default)


def str_or_none(value: JSON) -> str | None:
    """A field as text, null as absent."""
    return None if value is None else str(value)


def first_str(row: JSONObject, *keys: str) -> str | None:
    """The value of the first of keys the row has, as text (null as "None", as the log reader always wrote it);
    None when the row has none of them."""
    key = next((k for k in keys if k in row), None)
    return None if key is None else str(row[key])


def read_log(path: str | pathlib.Path) -> list[tuple[str, JSONObject]]:
    """The lines of a request log as (file:line, JSON object); every line must parse."""
    p = pathlib.Path(path)
    if not p.is_file():
        raise TraceError(f"log file {p} does not exist")
    objects = []
    for lineno, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{p}:{lineno}: not JSON: {exc}") from exc
        if not isinstance(obj, dict):
            raise TraceError(f"{p}:{lineno}: each line must be a JSON object")
        objects.append((f"{p}:{lineno}", obj))
    if not objects:
        raise TraceError(f"{p}: no requests in the log")
    return objects


def log_rows(path: str, output_len: int | None) -> Iterator[ImportedRow]:
    """conveyor's request log (trace_import.py's docstring), each line checked only when it is read.
    output_len, given, replaces every line's own output count."""
    return (log_row(obj, where, output_len) for where, obj in read_log(path))


def log_row(obj: JSONObject, where: str, output_len: int | None) -> ImportedRow:
    """One request-log line; fields are checked in the order the errors were always reported."""
    f = Fields.of(obj, where)  # raw reads: each value is checked here, with the importer's own messages
    timestamp = f.raw("timestamp")
    stamp = None if timestamp is None else timestamp_s(timestamp, where)
    prompt, messages = _log_text(obj, where)
    turn = f.raw("turn")
    if turn is not None and not isinstance(turn, int):
        raise TraceError(f"{where}: turn must be an integer and needs a session_id")
    session, logged = f.raw("session_id"), int_field(obj, "prompt_tokens")
    return ImportedRow(
        where=where, prompt=prompt, messages=messages, timestamp_s=stamp, turn=turn,
        output_tokens=output_len if output_len is not None else _output_count(obj),
        request_class=first_str(obj, "class", "request_class"), request_id=first_str(obj, "request_id"),
        session_id=str_or_none(session),
        prompt_tokens=logged if logged is not None and logged >= 0 else None)


def _log_text(obj: JSONObject, where: str) -> tuple[str | None, tuple[ChatMessage, ...] | None]:
    """(prompt, None) or (None, messages): a string prompt wins over messages."""
    prompt, messages = str_field(obj, "prompt"), list_field(obj, "messages")
    if prompt is not None:
        return prompt, None
    if not messages:
        raise TraceError(f"{where}: needs a string 'prompt' or a non-empty 'messages' list")
    out = []
    for i, m in enumerate(messages):
        content = str_field(m, "content") if isinstance(m, dict) else None
        if not isinstance(m, dict) or content is None:
            raise TraceError(f"{where}: messages[{i}] needs a string 'content'")
        out.append(chat_message(str_field(m, "role"), content))
    return None, tuple(out)


def _output_count(obj: JSONObject) -> int:
    """The first output count >= 1 of OUTPUT_KEYS; 0 when there is none (the row then reports it)."""
    counts = (obj.get(key) for key in OUTPUT_KEYS)
    return next((int(c) for c in counts if isinstance(c, int) and c >= 1), 0)
