"""Import requests from a file into a trace, optionally anonymized.

Formats (--format): `log`, conveyor's JSONL request log, one request per line: `timestamp` (seconds, or
ISO-8601), `prompt` or `messages`, the output token count (`output_tokens` | `completion_tokens` |
`output_len`), and optionally `class` (or `request_class`), `session_id`, `turn`, `prompt_tokens`,
`request_id` (import_rows.py); `openai-log`, `sharegpt` and `hf` (trace_readers.py). Each of these readers
parses a row once into a checked ImportedRow, and the rest of this module works on those records only.
`mooncake` and `random` (trace_synthetic.py) carry no text and are built synthetic. Rows with
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

import enum
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import numpy as np

from conveyor.bench.jsonvalue import JSONObject
from conveyor.bench.trace import trace_readers, trace_synthetic
from conveyor.bench.trace.import_rows import ImportedRow, log_rows
from conveyor.bench.trace.prefix_trie import PrefixTrie, shared_prefix
from conveyor.bench.trace.tokenizer_file import TokenCounter, load_tokenizer
from conveyor.bench.trace.trace_synthetic import RandomParams
from conveyor.bench.trace.traces import Trace, TraceError, TraceRequest, make_trace
from conveyor.bench.trace.wordlist import WORDS

Unit = tuple[int, str, str]  # (message index, role, word); prompts use (0, "", word)
Text = tuple[str | None, list[dict[str, str]] | None]  # a request's (prompt, messages): one is None


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


def _units(row: ImportedRow) -> list[Unit]:
    if row.prompt is not None:
        return [(0, "", w) for w in row.prompt.split()]
    return [(i, m.role, w) for i, m in enumerate(row.messages or ()) for w in m.content.split()]


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


def _rebuild(row: ImportedRow, units: list[Unit], new_words: list[str] | None) -> Text:
    """The request's (prompt, messages): the synthetic words (anonymized), else the original text unchanged."""
    if row.prompt is not None:
        return row.prompt if new_words is None else " ".join(new_words), None
    messages = []
    for i, m in enumerate(row.messages or ()):
        content = m.content if new_words is None else " ".join(w for u, w in zip(units, new_words) if u[0] == i)
        messages.append({"role": m.role, "content": content})
    return None, messages


def _order_and_stamps(rows: list[ImportedRow]) -> tuple[list[int], list[float | None]]:
    """Rows by timestamp (stable), arrival_s from the first; a file without timestamps keeps its order."""
    stamps = [r.timestamp_s for r in rows if r.timestamp_s is not None]
    if not stamps:
        return list(range(len(rows))), [None] * len(rows)
    if len(stamps) < len(rows):
        missing = next(r.where for r in rows if r.timestamp_s is None)
        raise TraceError(f"{missing}: no timestamp, while other requests have one (give all or none)")
    order = sorted(range(len(rows)), key=lambda i: stamps[i])
    t0 = stamps[order[0]]
    return order, [stamps[i] - t0 for i in order]


def rows_to_trace(rows: list[ImportedRow], cfg: ImportConfig, generator: JSONObject) -> Trace:
    """Imported rows -> trace, anonymized through the trie when asked (the module docstring's guarantees)."""
    if not rows:
        raise TraceError(f"{cfg.log_path}: no requests in the input")
    order, arrivals = _order_and_stamps(rows)
    units = [_units(rows[i]) for i in order]
    trie = PrefixTrie()
    paths = [trie.insert(u) for u in units]
    originals = {w for us in units for (_, _, w) in us} | {w.lower().strip(".,;:!?\"'()") for us in units
                                                           for (_, _, w) in us}
    word_of = _synthetic_words(trie, originals, cfg.seed) if cfg.anonymize else []
    sessions: dict[str, str] = {}
    for i in order:  # anonymized session ids: numbered by first appearance, never derived from the original
        session = rows[i].session_id
        if session is not None:
            sessions.setdefault(session, f"s{len(sessions)}")
    ctx = _Context(word_of=word_of, trie=trie, sessions=sessions)
    requests = [_to_request(cfg, rows[i], (units[k], paths[k]), arrivals[k], ctx) for k, i in enumerate(order)]
    keep_ids = [not cfg.anonymize and rows[i].request_id is not None for i in order]
    requests = [r if keep else _renumber(r, k) for k, (r, keep) in enumerate(zip(requests, keep_ids))]
    return make_trace(requests, seed=cfg.seed if cfg.anonymize else None, generator=generator)


def _reader_options(cfg: ImportConfig, counter: TokenCounter | None) -> trace_readers.ReaderOptions:
    count: Callable[[str], int] = counter.count if counter is not None else (lambda text: len(text.split()))
    return trace_readers.ReaderOptions(count=count, output_len=cfg.output_len, all_turns=cfg.turns is Turns.ALL,
                                       prompt_column=cfg.prompt_column, answer_column=cfg.answer_column)


def _read_rows(cfg: ImportConfig, counter: TokenCounter | None) -> list[ImportedRow]:
    """The first --num-requests rows of the input; rows after them are never checked."""
    path, opts = str(cfg.log_path), _reader_options(cfg, counter)
    readers: dict[ImportFormat, Callable[[str, trace_readers.ReaderOptions], Iterator[ImportedRow]]] = {
        ImportFormat.LOG: lambda path, opts: log_rows(path, opts.output_len),
        ImportFormat.OPENAI_LOG: trace_readers.openai_log_rows,
        ImportFormat.SHAREGPT: trace_readers.sharegpt_rows, ImportFormat.HF: trace_readers.hf_rows}
    return list(itertools.islice(readers[cfg.format](path, opts), cfg.num_requests))


def import_trace(cfg: ImportConfig) -> Trace:
    """Input file (or --format random) -> trace."""
    counter = load_tokenizer(cfg.tokenizer_path) if cfg.tokenizer_path else None
    generator: JSONObject = {"name": "import", "format": cfg.format.value, "log": cfg.log_path,
                                 "anonymize": cfg.anonymize, "prompt_len": _length_source(counter)}
    if cfg.format is ImportFormat.RANDOM:
        return trace_synthetic.random_trace(cfg.random, cfg.num_requests or 1000, counter, cfg.seed, generator)
    if cfg.format is ImportFormat.MOONCAKE:
        source = trace_synthetic.MooncakeSource(path=str(cfg.log_path), block_size=cfg.block_size, seed=cfg.seed,
                                                num_requests=cfg.num_requests)
        return trace_synthetic.mooncake_trace(source, counter, generator)
    trace = rows_to_trace(_read_rows(cfg, counter), cfg, generator)
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


def _to_request(cfg: ImportConfig, row: ImportedRow, units_path: tuple[list[Unit], list[int]],
                arrival_s: float | None, ctx: _Context) -> TraceRequest:
    units, path = units_path
    shared = shared_prefix(ctx.trie, path)
    prompt, messages = _rebuild(row, units, [ctx.word_of[n] for n in path] if cfg.anonymize else None)
    logged = None if cfg.anonymize else row.prompt_tokens
    session = row.session_id
    return TraceRequest(
        request_id=row.where if row.request_id is None else row.request_id,
        request_class=cfg.default_class if row.request_class is None else row.request_class,
        prompt_len=len(units) if logged is None else logged, output_len=row.output_tokens,
        arrival_s=None if arrival_s is None else round(arrival_s, 6),
        prefix_group=f"p{path[shared - 1]}" if shared else None, shared_prefix_len=shared,
        session_id=None if session is None else (ctx.sessions[session] if cfg.anonymize else session),
        turn=row.turn, ignore_eos=cfg.ignore_eos, prompt=prompt, messages=messages)
