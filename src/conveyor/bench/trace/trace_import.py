"""Import requests from a file into a trace, optionally anonymized.

Formats (--format): `log`, conveyor's JSONL request log, one request per line: `timestamp` (seconds, or
ISO-8601), `prompt` or `messages`, the output token count (`output_tokens` | `completion_tokens` |
`output_len`), and optionally `class` (or `request_class`), `session_id`, `turn`, `prompt_tokens`,
`request_id`; `openai-log`, `sharegpt` and `hf` (trace_readers.py), which become such entries first;
`mooncake` and `random` (trace_synthetic.py), which carry no text and are built synthetic. Entries with
timestamps are sorted by them (arrival_s relative to the first); a file without any stays untimed.
With --tokenizer every prompt_len is the tokenizer's exact count of the text written.

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
import enum
import json
import pathlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from conveyor.bench.trace import trace_readers, trace_synthetic
from conveyor.bench.trace.prefix_trie import PrefixTrie, shared_prefix
from conveyor.bench.trace.tokenizer_file import TokenCounter, load_tokenizer
from conveyor.bench.trace.trace_synthetic import RandomParams
from conveyor.bench.trace.traces import Trace, TraceError, TraceRequest, make_trace
from conveyor.bench.trace.wordlist import WORDS

ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
Unit = tuple[int, str, str]  # (message index, role, word); prompts use (0, "", word)


class ImportFormat(str, enum.Enum):
    LOG = "log"
    OPENAI_LOG = "openai-log"
    SHAREGPT = "sharegpt"
    HF = "hf"
    MOONCAKE = "mooncake"
    RANDOM = "random"


class Turns(str, enum.Enum):
    FIRST = "first"
    ALL = "all"


@dataclass(frozen=True, kw_only=True)
class ImportConfig:
    """`conveyor trace import` options."""

    log_path: str | None
    """Input file (None only for --format random)."""
    format: ImportFormat = ImportFormat.LOG
    """What the input file is."""
    anonymize: bool = False
    """Replace all text with synthetic words, keeping lengths and prefix sharing exactly."""
    default_class: str = "imported"
    """Class of log lines that name none."""
    seed: int = 0
    """Seed of the synthetic words."""
    ignore_eos: bool = True
    """Ask the server for exactly the logged output length."""
    tokenizer_path: str | None = None
    """tokenizer.json / model directory / GGUF for exact token lengths (None: words ≈ tokens)."""
    output_len: int | None = None
    """Fixed output length of every request (default: the file's reference answers)."""
    turns: Turns = Turns.FIRST
    """sharegpt / hf conversations: the first human message (vLLM), or all as session turns."""
    prompt_column: str | None = None
    """hf: the prompt column (default: detected)."""
    answer_column: str | None = None
    """hf: the reference-answer column (default: detected)."""
    num_requests: int | None = None
    """Keep the first N requests (random: make N)."""
    block_size: int = 512
    """mooncake: tokens per hash id (Mooncake's traces use 512)."""
    random: RandomParams = field(default_factory=RandomParams)
    """random: vLLM's --random-* parameters."""

    def __post_init__(self) -> None:
        if (self.log_path is None) != (self.format is ImportFormat.RANDOM):
            raise TraceError("give an input file, except with --format random (which makes its requests)")
        if self.output_len is not None and self.output_len < 1:
            raise TraceError("--output-len must be >= 1")
        if self.num_requests is not None and self.num_requests < 1:
            raise TraceError("--num-requests must be >= 1")
        if self.block_size < 1:
            raise TraceError("--block-size must be >= 1")


def _timestamp_s(value: Any, where: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
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


def _synthetic_words(trie: PrefixTrie, originals: set[str], seed: int) -> list[str]:
    """One word per node, distinct among siblings, never an original word."""
    vocab = [w for w in WORDS if w not in originals]
    rng = np.random.default_rng(seed)
    word_of = [""] * len(trie.children)
    for node, kids in enumerate(trie.children):
        if len(kids) > len(vocab):
            raise TraceError(f"cannot anonymize: {len(kids)} prompts diverge at one position but only "
                             f"{len(vocab)} synthetic words are free")
        picks: list[int] = rng.choice(len(vocab), size=len(kids), replace=False).tolist() if kids else []
        for child, pick in zip(kids.values(), picks):
            word_of[child] = vocab[int(pick)]
    return word_of


def _rebuild(entry: dict[str, Any], units: list[Unit], new_words: list[str] | None) -> dict[str, Any]:
    """The request's text: the synthetic words (anonymized), else the original text unchanged."""
    if "prompt" in entry and isinstance(entry["prompt"], str):
        return {"prompt": entry["prompt"] if new_words is None else " ".join(new_words)}
    messages = []
    for i, m in enumerate(entry["messages"]):
        role = m.get("role") if m.get("role") in ROLES else "user"
        content = m["content"] if new_words is None else " ".join(w for u, w in zip(units, new_words) if u[0] == i)
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


def _order_and_stamps(entries: list[dict[str, Any]]) -> tuple[list[int], list[float | None]]:
    """Entries by timestamp (stable), arrival_s from the first; a file without timestamps keeps its order."""
    timed = [e.get("timestamp") is not None for e in entries]
    if not any(timed):
        return list(range(len(entries))), [None] * len(entries)
    if not all(timed):
        missing = entries[timed.index(False)]["_where"]
        raise TraceError(f"{missing}: no timestamp, while other requests have one (give all or none)")
    stamps = [_timestamp_s(e["timestamp"], e["_where"]) for e in entries]
    order = sorted(range(len(entries)), key=lambda i: stamps[i])
    t0 = stamps[order[0]]
    return order, [stamps[i] - t0 for i in order]


def entries_to_trace(entries: list[dict[str, Any]], cfg: ImportConfig, generator: dict[str, Any]) -> Trace:
    """Log entries -> trace, anonymized through the trie when asked (the module docstring's guarantees)."""
    if not entries:
        raise TraceError(f"{cfg.log_path}: no requests in the input")
    order, arrivals = _order_and_stamps(entries)
    units = [_units(entries[i], entries[i]["_where"]) for i in order]
    trie = PrefixTrie()
    paths = [trie.insert(u) for u in units]
    originals = {w for us in units for (_, _, w) in us} | {w.lower().strip(".,;:!?\"'()") for us in units
                                                           for (_, _, w) in us}
    word_of = _synthetic_words(trie, originals, cfg.seed) if cfg.anonymize else []
    sessions: dict[str, str] = {}
    for i in order:  # anonymized session ids: numbered by first appearance, never derived from the original
        if entries[i].get("session_id") is not None:
            sessions.setdefault(str(entries[i]["session_id"]), f"s{len(sessions)}")
    ctx = _Context(word_of=word_of, trie=trie, sessions=sessions)
    requests = [_to_request(cfg, entries[i], (units[k], paths[k]), arrivals[k], ctx) for k, i in enumerate(order)]
    keep_ids = [not cfg.anonymize and "request_id" in entries[i] for i in order]
    requests = [r if keep else _renumber(r, k) for k, (r, keep) in enumerate(zip(requests, keep_ids))]
    return make_trace(requests, seed=cfg.seed if cfg.anonymize else None, generator=generator)


def _reader_options(cfg: ImportConfig, counter: TokenCounter | None) -> trace_readers.ReaderOptions:
    count: Callable[[str], int] = counter.count if counter is not None else (lambda text: len(text.split()))
    return trace_readers.ReaderOptions(count=count, output_len=cfg.output_len, all_turns=cfg.turns is Turns.ALL,
                                       prompt_column=cfg.prompt_column, answer_column=cfg.answer_column)


def _read_entries(cfg: ImportConfig, counter: TokenCounter | None) -> list[dict[str, Any]]:
    path, opts = str(cfg.log_path), _reader_options(cfg, counter)
    readers: dict[ImportFormat, Callable[[str, trace_readers.ReaderOptions], list[dict[str, Any]]]] = {
        ImportFormat.LOG: lambda path, _: read_log(path), ImportFormat.OPENAI_LOG: trace_readers.openai_log_entries,
        ImportFormat.SHAREGPT: trace_readers.sharegpt_entries, ImportFormat.HF: trace_readers.hf_entries}
    entries = readers[cfg.format](path, opts)
    if cfg.format is ImportFormat.LOG and cfg.output_len is not None:
        entries = [dict(e, output_tokens=cfg.output_len) for e in entries]
    return entries[: cfg.num_requests] if cfg.num_requests else entries


def import_trace(cfg: ImportConfig) -> Trace:
    """Input file (or --format random) -> trace."""
    counter = load_tokenizer(cfg.tokenizer_path) if cfg.tokenizer_path else None
    generator: dict[str, Any] = {"name": "import", "format": cfg.format.value, "log": cfg.log_path,
                                 "anonymize": cfg.anonymize, "prompt_len": _length_source(counter)}
    if cfg.format is ImportFormat.RANDOM:
        return trace_synthetic.random_trace(cfg.random, cfg.num_requests or 1000, counter, dict(generator, seed=cfg.seed))
    if cfg.format is ImportFormat.MOONCAKE:
        source = trace_synthetic.MooncakeSource(path=str(cfg.log_path), block_size=cfg.block_size, seed=cfg.seed,
                                                num_requests=cfg.num_requests)
        return trace_synthetic.mooncake_trace(source, counter, generator)
    trace = entries_to_trace(_read_entries(cfg, counter), cfg, generator)
    return trace if counter is None else with_counted_lengths(trace, counter)


def _length_source(counter: TokenCounter | None) -> str:
    return "words" if counter is None else f"tokenizer {counter.path}"


def with_counted_lengths(trace: Trace, counter: TokenCounter) -> Trace:
    """Every prompt_len the tokenizer's count of the text as written (messages flattened as the completions
    endpoint sends them; the chat endpoint's template adds its own tokens)."""
    def text_of(r: TraceRequest) -> str:
        return r.prompt if r.prompt is not None else "\n".join(f"{m['role']}: {m['content']}" for m in r.messages or [])

    requests = [replace(r, prompt_len=counter.count(text_of(r))) for r in trace.requests]
    return make_trace(requests, seed=trace.header.seed, generator=trace.header.generator)


@dataclass(frozen=True)
class _Context:
    word_of: list[str]
    """Synthetic word per trie node (empty when not anonymizing)."""
    trie: PrefixTrie
    """All prompts."""
    sessions: dict[str, str]
    """Original session id -> anonymized one."""


def _renumber(r: TraceRequest, k: int) -> TraceRequest:
    return replace(r, request_id=f"r{k:06d}")


def _to_request(cfg: ImportConfig, entry: dict[str, Any], units_path: tuple[list[Unit], list[int]],
                arrival_s: float | None, ctx: _Context) -> TraceRequest:
    units, path = units_path
    where = entry["_where"]
    shared = shared_prefix(ctx.trie, path)
    text = _rebuild(entry, units, [ctx.word_of[n] for n in path] if cfg.anonymize else None)
    logged = entry.get("prompt_tokens")
    prompt_tokens = logged if not cfg.anonymize and isinstance(logged, int) and logged >= 0 else len(units)
    klass = entry.get("class", entry.get("request_class", cfg.default_class))
    session = entry.get("session_id")
    turn = entry.get("turn")
    if turn is not None and (not isinstance(turn, int) or session is None):
        raise TraceError(f"{where}: turn must be an integer and needs a session_id")
    return TraceRequest(
        request_id=str(entry.get("request_id", where)),
        request_class=str(klass), prompt_len=prompt_tokens,
        output_len=_output_len(entry, where), arrival_s=None if arrival_s is None else round(arrival_s, 6),
        prefix_group=f"p{path[shared - 1]}" if shared else None, shared_prefix_len=shared,
        session_id=None if session is None else (ctx.sessions[str(session)] if cfg.anonymize else str(session)),
        turn=turn, ignore_eos=cfg.ignore_eos, **text)
