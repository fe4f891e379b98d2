"""Import a request log into a trace, optionally anonymized.

A log is JSONL, one request per line: `timestamp` (seconds, or ISO-8601), `prompt` or `messages`, the
output token count (`output_tokens` | `completion_tokens` | `output_len`), and optionally `class`
(or `request_class`), `session_id`, `prompt_tokens`, `request_id`.

Anonymization keeps the structure that matters to a server and nothing else. Each prompt is a sequence
of units: whitespace-separated words (for messages, a word together with its message index and role).
All prompts are inserted into one trie of units; every trie node gets a fresh synthetic word, distinct
among siblings, drawn from a vocabulary from which every original word has been removed. So each
request keeps its exact word count (per message), any two requests share exactly as many leading units
as before (they share exactly the same trie path), and no original word can appear in the output.
Word frequencies do not survive (the same original word at two nodes gets unrelated words).
"""

from __future__ import annotations

import datetime as dt
import json
import pathlib
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from conveyor.bench.traces import Trace, TraceError, TraceRequest, make_trace
from conveyor.bench.wordlist import WORDS

ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
Unit = tuple[int, str, str]  # (message index, role, word); prompts use (0, "", word)


@dataclass(frozen=True)
class ImportConfig:
    """`conveyor trace import` options."""

    log_path: str
    """Input log (JSONL)."""
    anonymize: bool = False
    """Replace all text with synthetic words, keeping lengths and prefix sharing exactly."""
    default_class: str = "imported"
    """Class of log lines that name none."""
    seed: int = 0
    """Seed of the synthetic words."""
    ignore_eos: bool = True
    """Ask the server for exactly the logged output length."""


def _timestamp_s(value: Any, where: str) -> float:
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            pass
    raise TraceError(f"{where}: timestamp must be seconds or ISO-8601, got {value!r}")


def _units(entry: dict[str, Any], where: str) -> list[Unit]:
    if isinstance(entry.get("prompt"), str):
        return [(0, "", w) for w in entry["prompt"].split()]
    messages = entry.get("messages")
    if not isinstance(messages, list) or not messages:
        raise TraceError(f"{where}: needs a string 'prompt' or a non-empty 'messages' list")
    units: list[Unit] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise TraceError(f"{where}: messages[{i}] needs a string 'content'")
        role = m.get("role") if m.get("role") in ROLES else "user"
        units.extend((i, str(role), w) for w in m["content"].split())
    return units


def _output_len(entry: dict[str, Any], where: str) -> int:
    for key in ("output_tokens", "completion_tokens", "output_len"):
        if isinstance(entry.get(key), int) and entry[key] >= 1:
            return int(entry[key])
    raise TraceError(f"{where}: needs an output token count >= 1 (output_tokens | completion_tokens | output_len)")


class _Trie:
    """Trie over units; node 0 is the root. Tracks how many prompts pass through each node."""

    def __init__(self) -> None:
        self.children: list[dict[Unit, int]] = [{}]
        self.count: list[int] = [0]

    def insert(self, units: list[Unit]) -> list[int]:
        node, path = 0, []
        for u in units:
            nxt = self.children[node].get(u)
            if nxt is None:
                nxt = len(self.children)
                self.children[node][u] = nxt
                self.children.append({})
                self.count.append(0)
            self.count[nxt] += 1
            path.append(nxt)
            node = nxt
        return path


def _synthetic_words(trie: _Trie, originals: set[str], seed: int) -> list[str]:
    """One word per node, distinct among siblings, never an original word."""
    vocab = [w for w in WORDS if w not in originals]
    rng = np.random.default_rng(seed)
    word_of = [""] * len(trie.children)
    for node, kids in enumerate(trie.children):
        if len(kids) > len(vocab):
            raise TraceError(f"cannot anonymize: {len(kids)} prompts diverge at one position but only "
                             f"{len(vocab)} synthetic words are free")
        picks = rng.choice(len(vocab), size=len(kids), replace=False) if kids else []
        for child, pick in zip(kids.values(), picks):
            word_of[child] = vocab[int(pick)]
    return word_of


def _rebuild(entry: dict[str, Any], units: list[Unit], new_words: list[str]) -> dict[str, Any]:
    if "prompt" in entry and isinstance(entry["prompt"], str):
        return {"prompt": " ".join(new_words)}
    messages = []
    for i, m in enumerate(entry["messages"]):
        role = m.get("role") if m.get("role") in ROLES else "user"
        content = " ".join(w for u, w in zip(units, new_words) if u[0] == i)
        messages.append({"role": str(role), "content": content})
    return {"messages": messages}


def read_log(path: str | pathlib.Path) -> list[dict[str, Any]]:
    p = pathlib.Path(path)
    if not p.is_file():
        raise TraceError(f"log file {p} does not exist")
    entries = []
    for lineno, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{p}:{lineno}: not JSON: {exc}") from exc
        if not isinstance(entry, dict):
            raise TraceError(f"{p}:{lineno}: each line must be a JSON object")
        entry["_where"] = f"{p}:{lineno}"
        entries.append(entry)
    if not entries:
        raise TraceError(f"{p}: no requests in the log")
    return entries


def import_log(cfg: ImportConfig) -> Trace:
    """Log -> trace (sorted by timestamp, arrival_s relative to the first request)."""
    entries = read_log(cfg.log_path)
    stamps = [_timestamp_s(e.get("timestamp"), e["_where"]) for e in entries]
    order = sorted(range(len(entries)), key=lambda i: stamps[i])
    units = [_units(entries[i], entries[i]["_where"]) for i in order]
    trie = _Trie()
    paths = [trie.insert(u) for u in units]
    originals = {w for us in units for (_, _, w) in us} | {w.lower().strip(".,;:!?\"'()") for us in units
                                                           for (_, _, w) in us}
    word_of = _synthetic_words(trie, originals, cfg.seed) if cfg.anonymize else []
    t0 = stamps[order[0]]
    sessions: dict[str, str] = {}
    for i in order:  # anonymized session ids: numbered by first appearance, never derived from the original
        if entries[i].get("session_id") is not None:
            sessions.setdefault(str(entries[i]["session_id"]), f"s{len(sessions)}")
    ctx = _Context(word_of=word_of, trie=trie, sessions=sessions)
    requests = [_to_request(cfg, entries[i], (units[k], paths[k]), stamps[i] - t0, ctx)
                for k, i in enumerate(order)]
    keep_ids = [not cfg.anonymize and "request_id" in entries[i] for i in order]
    requests = [r if keep else _renumber(r, k) for k, (r, keep) in enumerate(zip(requests, keep_ids))]
    generator = {"name": "import", "log": str(cfg.log_path), "anonymize": cfg.anonymize}
    return make_trace(requests, seed=cfg.seed if cfg.anonymize else None, generator=generator)


@dataclass(frozen=True)
class _Context:
    word_of: list[str]
    """Synthetic word per trie node (empty when not anonymizing)."""
    trie: _Trie
    """All prompts."""
    sessions: dict[str, str]
    """Original session id -> anonymized one."""


def _renumber(r: TraceRequest, k: int) -> TraceRequest:
    return replace(r, request_id=f"r{k:06d}")


def _to_request(cfg: ImportConfig, entry: dict[str, Any], units_path: tuple[list[Unit], list[int]],
                arrival_s: float, ctx: _Context) -> TraceRequest:
    units, path = units_path
    where = entry["_where"]
    shared = max((d + 1 for d, node in enumerate(path) if ctx.trie.count[node] >= 2), default=0)
    new_words = [ctx.word_of[n] for n in path] if cfg.anonymize else [u[2] for u in units]
    text = _rebuild(entry, units, new_words)
    prompt_tokens = entry.get("prompt_tokens")
    keep_count = not cfg.anonymize and isinstance(prompt_tokens, int) and prompt_tokens >= 0
    klass = entry.get("class", entry.get("request_class", cfg.default_class))
    session = entry.get("session_id")
    return TraceRequest(
        request_id=str(entry.get("request_id", where)),
        request_class=str(klass), prompt_len=int(prompt_tokens) if keep_count else len(units),
        output_len=_output_len(entry, where), arrival_s=round(arrival_s, 6),
        prefix_group=f"p{path[shared - 1]}" if shared else None, shared_prefix_len=shared,
        session_id=None if session is None else (ctx.sessions[str(session)] if cfg.anonymize else str(session)),
        ignore_eos=cfg.ignore_eos, **text)
