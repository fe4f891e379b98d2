"""Readers of other tools' request files, each parsing its rows once into the importer's ImportedRow.

An ImportedRow (import_rows.py) is one checked request: `prompt` or `messages`, the output count, and
optionally a timestamp, class, session and turn, logged prompt length and request id, plus where it came
from (file and row, for errors). Every reader ends there, so every format goes through the same trie
anonymizer and keeps its guarantees. Output lengths come from the reference answer the row carries (tokens with a
tokenizer, else words, as vLLM counts ShareGPT completions with its tokenizer) unless a fixed length
is given. Readers:

- sharegpt: a JSON list of {"conversations": [{"from": "human"|"gpt"|"system", "value": ...}, ...]}.
  `first` (vLLM's sampler): the first human message, the length of the reply after it, rows with fewer
  than two messages skipped and vLLM's length filter applied (prompt and output >= 4 tokens, prompt
  <= 1024, total <= 2048). `all`: every human message becomes a turn of the conversation's session
  (its history is then the answers the server gives, sessions.py). System messages before a human
  message are kept with it as chat messages.
- hf: a Hugging Face dataset exported locally (`Dataset.to_json` JSONL, a JSON list, or Parquet, which
  needs pyarrow): rows with `conversations` (ShareGPT shape) or `messages` (OpenAI chat) are read as
  such; otherwise the prompt column (given, or the first of prompt/instruction/question/query/input/
  text; Alpaca's instruction + input are joined) and the answer column (given, or the first of
  completion/response/output/answer/chosen).
- openai-log: one JSON object a line, {"timestamp", "request": {OpenAI body}, "response": {OpenAI
  response}}; the output count is the response's usage.completion_tokens, else the request's max_tokens.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from conveyor.bench.jsonvalue import JSON, Fields, JSONObject
from conveyor.bench.trace.import_rows import (
    ChatMessage,
    ImportedRow,
    chat_message,
    first_str,
    first_value,
    int_field,
    list_field,
    object_field,
    str_field,
    str_or_none,
    timestamp_s,
)
from conveyor.bench.trace.traces import TraceError

PROMPT_COLUMNS = ("prompt", "instruction", "question", "query", "input", "text")
ANSWER_COLUMNS = ("completion", "response", "output", "answer", "chosen")
ROLE_OF = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
           "bard": "assistant", "bing": "assistant", "system": "system"}


@dataclass(frozen=True)
class ReaderOptions:
    """How rows become requests."""

    count: Callable[[str], int]
    """Tokens (or words) of a text: the output length of a reference answer."""
    output_len: int | None = None
    """Fixed output length for every request (vLLM's --sharegpt-output-len / --hf-output-len)."""
    all_turns: bool = False
    """sharegpt / conversations: every human message is a turn (else the first only, as vLLM)."""
    prompt_column: str | None = None
    """hf: the prompt column (default: detected)."""
    answer_column: str | None = None
    """hf: the reference-answer column (default: detected)."""


def _load_json_rows(path: pathlib.Path) -> list[JSON]:
    """A JSON list, a {"data": [...]} object, or JSON Lines."""
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        rows = []
        for lineno, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise TraceError(f"{path}:{lineno}: neither a JSON document nor JSON Lines: {exc}") from exc
        return rows
    inner = Fields.of(data, str(path)).raw("data") if isinstance(data, dict) else data
    return list(inner) if isinstance(inner, list) else [data]


def load_rows(path: str) -> list[JSONObject]:
    """The rows of a .json / .jsonl / .parquet file, as dicts."""
    p = pathlib.Path(path)
    if not p.is_file():
        raise TraceError(f"input file {p} does not exist")
    if p.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq  # type: ignore[import-untyped]
        except ImportError as exc:
            raise TraceError(f"{p}: reading Parquet needs pyarrow: pip install 'conveyor[datasets]'") from exc
        rows: list[JSON] = pq.read_table(p).to_pylist()
    else:
        rows = _load_json_rows(p)
    objects = [r for r in rows if isinstance(r, dict)]
    if len(objects) < len(rows):
        bad = next(i for i, r in enumerate(rows) if not isinstance(r, dict))
        raise TraceError(f"{p}: row {bad} is not an object")
    return objects


def _answer_len(text: str, opts: ReaderOptions) -> int:
    return opts.output_len if opts.output_len is not None else max(1, opts.count(text))


def _message(m: JSONObject) -> tuple[str, str]:
    """(role, text) of a ShareGPT ({from, value}) or chat ({role, content}) message; unknown roles are users."""
    speaker = first_str(m, "from", "role")
    text = first_str(m, "value", "content")
    return ROLE_OF.get((speaker or "").lower(), "user"), "" if text is None else text


def _conversation_rows(turns: list[JSON], where: str, opts: ReaderOptions, session: str) -> list[ImportedRow]:
    """ShareGPT- or chat-shaped messages -> one row per human message (all) or the first one only. System
    messages before it go with it as chat messages (the shared system prompt is what a prefix cache sees)."""
    messages = [_message(m) for m in turns if isinstance(m, dict)]
    out: list[ImportedRow] = []
    system: list[ChatMessage] = []
    for i, (role, text) in enumerate(messages):
        if role == "system":
            system.append(ChatMessage(role="system", content=text))
        if role != "user":
            continue
        reply = messages[i + 1][1] if i + 1 < len(messages) and messages[i + 1][0] == "assistant" else ""
        user = ChatMessage(role="user", content=text)
        out.append(ImportedRow(
            where=f"{where} message {i}", output_tokens=_answer_len(reply, opts),
            prompt=None if system else text, messages=(*system, user) if system else None,
            session_id=session if opts.all_turns else None, turn=len(out) if opts.all_turns else None))
        system = []
        if not opts.all_turns:
            break
    return out


def _vllm_keeps(row: ImportedRow, opts: ReaderOptions) -> bool:
    """vLLM's ShareGPT filter (is_valid_sequence): prompt and output >= 4, prompt <= 1024, total <= 2048."""
    prompt_len, output_len = opts.count(row.text), row.output_tokens
    output_ok = opts.output_len is not None or output_len >= 4
    return prompt_len >= 4 and output_ok and prompt_len <= 1024 and prompt_len + output_len <= 2048


def sharegpt_rows(path: str, opts: ReaderOptions) -> Iterator[ImportedRow]:
    for i, row in enumerate(load_rows(path)):
        turns = list_field(row, "conversations")
        if turns is None or len(turns) < 2:
            continue
        session = first_str(row, "id")
        found = _conversation_rows(turns, f"{path} row {i}", opts, str(i) if session is None else session)
        yield from (found if opts.all_turns else [r for r in found if _vllm_keeps(r, opts)])


def _column(row: JSONObject, given: str | None, candidates: tuple[str, ...], where: str) -> str | None:
    if given is not None:
        if given not in row:
            raise TraceError(f"{where}: no column {given!r} (columns: {', '.join(row)})")
        return given
    return next((c for c in candidates if isinstance(row.get(c), str) and row[c]), None)


def _hf_row(row: JSONObject, where: str, opts: ReaderOptions, session: str) -> list[ImportedRow]:
    for shape in ("conversations", "messages"):
        turns = list_field(row, shape)
        if turns is not None and opts.prompt_column is None:
            return _conversation_rows(turns, where, opts, session)
    prompt_key = _column(row, opts.prompt_column, PROMPT_COLUMNS, where)
    if prompt_key is None:
        raise TraceError(f"{where}: no prompt column found (columns: {', '.join(row)}); name one with --prompt-column")
    prompt, extra = str(row[prompt_key]), str_field(row, "input")
    if prompt_key == "instruction" and extra:
        prompt = f"{prompt}\n{extra}"  # Alpaca
    answer_key = _column(row, opts.answer_column, ANSWER_COLUMNS, where)
    answer = str(row[answer_key]) if answer_key is not None else ""
    if answer_key is None and opts.output_len is None:
        raise TraceError(f"{where}: no answer column to take output lengths from; give --output-len or --answer-column")
    return [ImportedRow(where=where, prompt=prompt, output_tokens=_answer_len(answer, opts))]


def hf_rows(path: str, opts: ReaderOptions) -> Iterator[ImportedRow]:
    return (r for i, row in enumerate(load_rows(path)) for r in _hf_row(row, f"{path} row {i}", opts, str(i)))


def _openai_row(line: JSONObject, where: str, opts: ReaderOptions) -> ImportedRow:
    # Raw reads, each value checked here: a log line's fields are another tool's, any of them may be missing.
    row = Fields.of(line, where)
    body = row.raw("request") or row.raw("body")
    if not isinstance(body, dict):
        raise TraceError(f"{where}: needs a 'request' object (the OpenAI request body)")
    request = Fields.of(body, f"{where}: request")
    response_obj = object_field(line, "response")
    response, usage = Fields.of(response_obj, where), object_field(response_obj, "usage")
    output = opts.output_len or Fields.of(usage, where).raw("completion_tokens") \
        or request.raw("max_completion_tokens") or request.raw("max_tokens")
    stamp = first_value(line, ("timestamp", "created"), response.raw("created"))
    prompt, messages = _openai_text(body)
    logged = int_field(usage, "prompt_tokens")
    return ImportedRow(
        where=where, prompt=prompt, messages=messages,
        output_tokens=int(output) if isinstance(output, int) and output >= 1 else 0,
        timestamp_s=None if stamp is None else timestamp_s(stamp, where), request_class=str_or_none(row.raw("class")),
        session_id=str_or_none(first_value(line, ("session_id",), request.raw("user"))),
        request_id=str_or_none(first_value(line, ("request_id",), response.raw("id"))),
        prompt_tokens=logged if logged is not None and logged >= 0 else None)


def _openai_text(request: JSONObject) -> tuple[str | None, tuple[ChatMessage, ...] | None]:
    """(prompt, None) or (None, messages); list contents (text parts, images) are kept as their JSON."""
    messages = list_field(request, "messages")
    if messages is None:
        return str_field(request, "prompt"), None
    chat = [(str_field(m, "role"), Fields.of(m, "").raw("content")) for m in messages if isinstance(m, dict)]
    return None, tuple(chat_message(role, c if isinstance(c, str) else json.dumps(c)) for role, c in chat)


def openai_log_rows(path: str, opts: ReaderOptions) -> Iterator[ImportedRow]:
    return (_openai_row(row, f"{path}:{i + 1}", opts) for i, row in enumerate(load_rows(path)))
