"""Request traces: the versioned JSONL format the benchmark replays (docs/trace-format.md).

A trace file is one header line, then one request per line. The header's `version` is the sha256 of the
request lines exactly as written, so two runs that name the same version replayed the same requests, and
a trace edited by hand no longer verifies. Request lines are canonical JSON (sorted keys, no spaces) so
the hash does not depend on who wrote the file. Generators live in trace_gen.py, import/anonymize in
trace_import.py; this module is only the format.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, cast

from conveyor.bench.jsonvalue import Fields, JSONObject

TRACE_FORMAT = "conveyor-trace"
TRACE_FORMAT_VERSION = 1


class TraceError(ValueError):
    """A trace file that cannot be read: the message names the file, line and field."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: what to send, and when the trace itself says it arrived."""

    request_id: str
    """Unique within the trace; sent as the `x-request-id` header."""
    request_class: str
    """Traffic class (`chat`, `long`, `agent`, or a class named by an imported log)."""
    prompt_len: int
    """Prompt length in tokens (exact if measured, else the word-count approximation)."""
    output_len: int
    """Requested output tokens (`max_tokens` / `max_completion_tokens`)."""
    prompt: str | None = None
    """Plain-text prompt (completions); exactly one of prompt / messages / prompt_token_ids is set."""
    messages: list[dict[str, str]] | None = None
    """Chat messages [{role, content}] (chat endpoint)."""
    prompt_token_ids: list[int] | None = None
    """Pre-tokenized prompt (completions endpoint only)."""
    arrival_s: float | None = None
    """The trace's own arrival timestamp, seconds from the trace start (used by --arrival replay)."""
    prefix_group: str | None = None
    """Requests of one group share their first `shared_prefix_len` tokens (system prompt + documents)."""
    shared_prefix_len: int = 0
    """Leading tokens shared with the rest of `prefix_group`."""
    cancel_after_s: float | None = None
    """Close the stream this long after sending (the user gave up)."""
    cancel_after_tokens: int | None = None
    """Close the stream after this many streamed chunks."""
    session_id: str | None = None
    """Conversation / user session, when the source has one."""
    turn: int | None = None
    """Turn index within `session_id` (0, 1, ...): set, the turns are sent in order, each after the previous
    answer, with the history (earlier inputs and the answers actually received) before this turn's input."""
    think_time_s: float | None = None
    """Turns after the first: pause between the previous answer and this turn (the user reading/typing)."""
    ignore_eos: bool = True
    """Ask the server to generate exactly output_len tokens (vLLM's ignore_eos)."""

    def __post_init__(self) -> None:
        num_inputs = sum(x is not None for x in (self.prompt, self.messages, self.prompt_token_ids))
        if num_inputs != 1:
            raise TraceError(f"request {self.request_id}: exactly one of prompt, messages, prompt_token_ids "
                             f"must be set (got {num_inputs})")
        if self.prompt_len < 0 or self.output_len < 1:
            raise TraceError(f"request {self.request_id}: prompt_len must be >= 0 and output_len >= 1")
        if self.cancel_after_tokens is not None and self.cancel_after_tokens < 1:
            raise TraceError(f"request {self.request_id}: cancel_after_tokens must be >= 1")
        if self.cancel_after_s is not None and self.cancel_after_s < 0:
            raise TraceError(f"request {self.request_id}: cancel_after_s must be >= 0")
        self._check_turn()

    def _check_turn(self) -> None:
        if self.turn is not None and (self.session_id is None or self.turn < 0):
            raise TraceError(f"request {self.request_id}: turn needs a session_id and must be >= 0")
        if self.think_time_s is not None and (self.turn is None or self.think_time_s < 0):
            raise TraceError(f"request {self.request_id}: think_time_s needs a turn and must be >= 0")
        if self.turn is not None and self.prompt_token_ids is not None:
            raise TraceError(f"request {self.request_id}: a session turn needs prompt or messages (its history "
                             "is text), not prompt_token_ids")

    def to_json(self) -> str:
        """Canonical line: sorted keys, no None fields, no spaces."""
        data = {k: v for k in self.__dataclass_fields__ if (v := getattr(self, k)) is not None}
        return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> TraceRequest:
        """A request line's object: each field's JSON type checked here, the values' rules in __post_init__."""
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise TraceError(f"unknown request field(s) {sorted(unknown)}")
        for key, value in data.items():
            if not _has_json_type(key, value, cls.__dataclass_fields__[key].default is None):
                kinds = " or ".join(k.__name__ for k in _FIELD_TYPES[key])
                raise TraceError(f"field {key} must be {kinds}, got {value!r}")
        try:
            return cls(**cast(dict[str, Any], data))  # every value's type checked above
        except TypeError as exc:
            raise TraceError(str(exc)) from exc


_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "request_id": (str,), "request_class": (str,), "prompt_len": (int,), "output_len": (int,), "prompt": (str,),
    "messages": (list,), "prompt_token_ids": (list,), "arrival_s": (int, float), "prefix_group": (str,),
    "shared_prefix_len": (int,), "cancel_after_s": (int, float), "cancel_after_tokens": (int,),
    "session_id": (str,), "turn": (int,), "think_time_s": (int, float), "ignore_eos": (bool,)}
"""The JSON types a request line may give each TraceRequest field."""


def _has_json_type(key: str, value: object, nullable: bool) -> bool:
    """Messages must be objects and token ids integers; a null only where the field defaults to None."""
    if value is None:
        return nullable
    if not isinstance(value, _FIELD_TYPES[key]):
        return False
    if key == "messages" and isinstance(value, list):
        return all(isinstance(m, dict) for m in value)
    if key == "prompt_token_ids" and isinstance(value, list):
        return all(isinstance(i, int) for i in value)
    return True


@dataclass(frozen=True)
class TraceHeader:
    """First line of a trace file."""

    version: str
    """sha256 hex digest of the request lines (each followed by a newline)."""
    num_requests: int
    """Number of request lines."""
    classes: dict[str, int] = field(default_factory=dict)
    """Request count per class."""
    seed: int | None = None
    """Seed the generator used (None for imported traces)."""
    generator: JSONObject = field(default_factory=dict)
    """Generator name and every parameter it used, so the trace can be regenerated."""
    format: str = TRACE_FORMAT
    """Always "conveyor-trace"."""
    format_version: int = TRACE_FORMAT_VERSION
    """Version of this file format (not of the content)."""


@dataclass(frozen=True)
class Trace:
    """A header and its requests."""

    header: TraceHeader
    """The header line."""
    requests: list[TraceRequest]
    """Requests in file order (the order they are dispatched in)."""


def content_version(lines: list[str]) -> str:
    """The trace version: sha256 over the canonical request lines."""
    digest = hashlib.sha256()
    for line in lines:
        digest.update(line.encode("utf-8"))
        digest.update(b"\n")
    return digest.hexdigest()


def make_trace(requests: list[TraceRequest], seed: int | None, generator: JSONObject) -> Trace:
    """Wrap requests in a header whose version hashes their content."""
    ids = [r.request_id for r in requests]
    if len(set(ids)) != len(ids):
        raise TraceError("request_id values must be unique within a trace")
    dispatch_units(requests)  # turns of each session must be numbered 0..k-1
    classes: dict[str, int] = {}
    for r in requests:
        classes[r.request_class] = classes.get(r.request_class, 0) + 1
    version = content_version([r.to_json() for r in requests])
    header = TraceHeader(version=version, num_requests=len(requests), classes=classes, seed=seed,
                         generator=generator)
    return Trace(header=header, requests=requests)


def dispatch_units(requests: list[TraceRequest]) -> list[list[TraceRequest]]:
    """What the arrival process schedules, in trace order: each standalone request alone, and each session
    (requests with a `turn`) as its turns in turn order, at the position of its first line in the file."""
    units: list[list[TraceRequest]] = []
    sessions: dict[str, list[TraceRequest]] = {}
    for r in requests:
        if r.turn is None:
            units.append([r])
        elif r.session_id in sessions:
            sessions[str(r.session_id)].append(r)
        else:
            sessions[str(r.session_id)] = [r]
            units.append(sessions[str(r.session_id)])
    for sid, turns in sessions.items():
        turns.sort(key=lambda r: r.turn or 0)
        if [r.turn for r in turns] != list(range(len(turns))):
            raise TraceError(f"session {sid}: turns must be numbered 0..{len(turns) - 1} once each, "
                             f"got {[r.turn for r in turns]}")
    return units


def write_trace(trace: Trace, path: str | pathlib.Path) -> None:
    lines = [json.dumps(asdict(trace.header), sort_keys=True)] + [r.to_json() for r in trace.requests]
    pathlib.Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")


def read_trace(path: str | pathlib.Path, verify: bool = True) -> Trace:
    """Read and (by default) verify a trace; errors name the file and line."""
    p = pathlib.Path(path)
    if not p.is_file():
        raise TraceError(f"trace file {p} does not exist")
    raw_lines = [line for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not raw_lines:
        raise TraceError(f"{p}: empty trace file")
    header = _parse_header(p, raw_lines[0])
    requests = []
    for lineno, line in enumerate(raw_lines[1:], start=2):
        try:
            requests.append(TraceRequest.from_dict(json.loads(line)))
        except (json.JSONDecodeError, TraceError) as exc:
            raise TraceError(f"{p}:{lineno}: {exc}") from exc
    if verify:
        actual = content_version([r.to_json() for r in requests])
        if actual != header.version:
            raise TraceError(f"{p}: content does not match header version {header.version[:12]} "
                             f"(got {actual[:12]}); the file was edited — regenerate it")
    return Trace(header=header, requests=requests)


def _parse_header(path: pathlib.Path, line: str) -> TraceHeader:
    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{path}:1: header is not JSON: {exc}") from exc
    header = Fields.of(data, f"{path}:1") if isinstance(data, dict) else None
    if header is None or header.raw("format") != TRACE_FORMAT:
        raise TraceError(f"{path}:1: not a conveyor trace (header format must be {TRACE_FORMAT!r})")
    version = header.raw("format_version")
    if version != TRACE_FORMAT_VERSION:
        raise TraceError(f"{path}:1: format_version {version} is not supported "
                         f"(this conveyor reads {TRACE_FORMAT_VERSION})")
    try:
        return TraceHeader(**data)
    except TypeError as exc:
        raise TraceError(f"{path}:1: bad header: {exc}") from exc
