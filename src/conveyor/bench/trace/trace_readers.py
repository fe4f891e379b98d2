"""Readers of other tools' request files, each turning its rows into the importer's log entries.

A log entry (trace_import.py) is a dict: `prompt` or `messages`, `output_tokens`, and optionally
`timestamp`, `class`, `session_id`, `turn`, `prompt_tokens`, `request_id`, plus `_where` (file:row,
for errors). Every reader ends there, so every format goes through the same trie anonymizer and keeps
its guarantees. Output lengths come from the reference answer the row carries (tokens with a
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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from conveyor.bench.trace.traces import TraceError

PROMPT_COLUMNS = ("prompt", "instruction", "question", "query", "input", "text")
ANSWER_COLUMNS = ("completion", "response", "output", "answer", "chosen")
ROLE_OF = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
           "bard": "assistant", "bing": "assistant", "system": "system"}
Entry = dict[str, Any]


@dataclass(frozen=True)
class ReaderOptions:
    """How rows become entries."""

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


def _load_json_rows(path: pathlib.Path) -> list[Any]:
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
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        return list(data["data"])
    return data if isinstance(data, list) else [data]


def load_rows(path: str) -> list[dict[str, Any]]:
    """The rows of a .json / .jsonl / .parquet file, as dicts."""
    p = pathlib.Path(path)
    if not p.is_file():
        raise TraceError(f"input file {p} does not exist")
    if p.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq  # type: ignore[import-untyped]
        except ImportError as exc:
            raise TraceError(f"{p}: reading Parquet needs pyarrow: pip install 'conveyor[datasets]'") from exc
        rows: list[Any] = pq.read_table(p).to_pylist()
    else:
        rows = _load_json_rows(p)
    bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict)), None)
    if bad is not None:
        raise TraceError(f"{p}: row {bad} is not an object")
    return rows


def _answer_len(text: str, opts: ReaderOptions) -> int:
    return opts.output_len if opts.output_len is not None else max(1, opts.count(text))


def _conversation_entries(turns: list[Any], where: str, opts: ReaderOptions, session: str) -> list[Entry]:
    """ShareGPT- or chat-shaped messages -> one entry per human message (all) or the first one only. System
    messages before it go with it as chat messages (the shared system prompt is what a prefix cache sees)."""
    messages = [(ROLE_OF.get(str(m.get("from", m.get("role", ""))).lower(), "user"),
                 str(m.get("value", m.get("content", "")))) for m in turns if isinstance(m, dict)]
    out: list[Entry] = []
    system: list[dict[str, str]] = []
    for i, (role, text) in enumerate(messages):
        if role == "system":
            system.append({"role": "system", "content": text})
        if role != "user":
            continue
        reply = messages[i + 1][1] if i + 1 < len(messages) and messages[i + 1][0] == "assistant" else ""
        entry: Entry = {"output_tokens": _answer_len(reply, opts), "_where": f"{where} message {i}"}
        entry.update({"messages": system + [{"role": "user", "content": text}]} if system else {"prompt": text})
        system = []
        if opts.all_turns:
            entry.update(session_id=session, turn=len(out))
        out.append(entry)
        if not opts.all_turns:
            break
    return out


def _vllm_keeps(entry: Entry, opts: ReaderOptions) -> bool:
    """vLLM's ShareGPT filter (is_valid_sequence): prompt and output >= 4, prompt <= 1024, total <= 2048."""
    text = entry.get("prompt") or " ".join(m["content"] for m in entry["messages"])
    prompt_len, output_len = opts.count(str(text)), int(entry["output_tokens"])
    output_ok = opts.output_len is not None or output_len >= 4
    return prompt_len >= 4 and output_ok and prompt_len <= 1024 and prompt_len + output_len <= 2048


def sharegpt_entries(path: str, opts: ReaderOptions) -> list[Entry]:
    entries: list[Entry] = []
    for i, row in enumerate(load_rows(path)):
        turns = row.get("conversations")
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        found = _conversation_entries(turns, f"{path} row {i}", opts, str(row.get("id", i)))
        entries.extend(found if opts.all_turns else [e for e in found if _vllm_keeps(e, opts)])
    return entries


def _column(row: dict[str, Any], given: str | None, candidates: tuple[str, ...], where: str) -> str | None:
    if given is not None:
        if given not in row:
            raise TraceError(f"{where}: no column {given!r} (columns: {', '.join(row)})")
        return given
    return next((c for c in candidates if isinstance(row.get(c), str) and row[c]), None)


def _hf_row(row: dict[str, Any], where: str, opts: ReaderOptions, session: str) -> list[Entry]:
    if isinstance(row.get("conversations"), list) and opts.prompt_column is None:
        return _conversation_entries(row["conversations"], where, opts, session)
    if isinstance(row.get("messages"), list) and opts.prompt_column is None:
        return _conversation_entries(row["messages"], where, opts, session)
    prompt_key = _column(row, opts.prompt_column, PROMPT_COLUMNS, where)
    if prompt_key is None:
        raise TraceError(f"{where}: no prompt column found (columns: {', '.join(row)}); name one with --prompt-column")
    prompt = str(row[prompt_key])
    if prompt_key == "instruction" and isinstance(row.get("input"), str) and row["input"]:
        prompt = f"{prompt}\n{row['input']}"  # Alpaca
    answer_key = _column(row, opts.answer_column, ANSWER_COLUMNS, where)
    answer = str(row[answer_key]) if answer_key is not None else ""
    if answer_key is None and opts.output_len is None:
        raise TraceError(f"{where}: no answer column to take output lengths from; give --output-len or --answer-column")
    return [{"prompt": prompt, "output_tokens": _answer_len(answer, opts), "_where": where}]


def hf_entries(path: str, opts: ReaderOptions) -> list[Entry]:
    return [e for i, row in enumerate(load_rows(path)) for e in _hf_row(row, f"{path} row {i}", opts, str(i))]


def _openai_entry(line: dict[str, Any], where: str, opts: ReaderOptions) -> Entry:
    request = line.get("request") or line.get("body")
    if not isinstance(request, dict):
        raise TraceError(f"{where}: needs a 'request' object (the OpenAI request body)")
    response: dict[str, Any] = line["response"] if isinstance(line.get("response"), dict) else {}
    usage = response.get("usage") or {}
    output = usage.get("completion_tokens") or request.get("max_completion_tokens") or request.get("max_tokens")
    entry: Entry = {"timestamp": line.get("timestamp", line.get("created", response.get("created"))), "_where": where,
                    "output_tokens": opts.output_len or output}
    if isinstance(request.get("messages"), list):
        entry["messages"] = [{"role": m.get("role"), "content": m.get("content") if isinstance(m.get("content"), str)
                              else json.dumps(m.get("content"))} for m in request["messages"] if isinstance(m, dict)]
    else:
        entry["prompt"] = request.get("prompt")
    if isinstance(usage.get("prompt_tokens"), int):
        entry["prompt_tokens"] = usage["prompt_tokens"]
    for key, value in (("class", line.get("class")), ("session_id", line.get("session_id", request.get("user"))),
                       ("request_id", line.get("request_id", response.get("id")))):
        if value is not None:
            entry[key] = value
    return entry


def openai_log_entries(path: str, opts: ReaderOptions) -> list[Entry]:
    rows = load_rows(path)
    return [_openai_entry(row, f"{path}:{i + 1}", opts) for i, row in enumerate(rows)]
