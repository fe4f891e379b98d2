"""Traces with no text to start from: vLLM's `random` dataset and Mooncake-style traces.

`random` is `vllm bench serve --dataset-name random`: input and output lengths uniform in
[len·(1−r), len·(1+r)] (the tokenizer's special tokens taken off the input first), a prefix of
`prefix_len` random tokens shared by every request, and each request's body the run of vocabulary ids
(offset + index + arange(len)) mod |vocab|, drawn with numpy's default_rng(seed) in vLLM's order. With
--tokenizer the ids are that tokenizer's ordinary (non-special) ids, decoded to text, re-encoded and
adjusted until the count is right (vLLM's decode-to-target loop, 10 tries), and prompt_len is the
exact count; without one the vocabulary is the word list (one token per word: prompt_len ≈ tokens).

A Mooncake trace is JSONL: `timestamp` (milliseconds), `input_length`, `output_length` and `hash_ids`,
one id per `block_size` tokens of the prompt (512 in Mooncake's traces), equal ids meaning equal blocks.
Each hash id becomes one block of content drawn from a generator seeded by (seed, id), so requests that
list the same leading ids really share those leading tokens and nothing else, and the prefix cache sees
exactly the reuse the trace recorded. With --tokenizer the blocks are token ids (sent as
prompt_token_ids: exact lengths and exact sharing, completions endpoint only); without, words. The
trace's ids themselves are never written (prefix_group names a trie node), so nothing of the source
but lengths, times and sharing survives, which is the importer's anonymization guarantee.
"""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from conveyor.bench.jsonvalue import JSON, JSONObject
from conveyor.bench.trace.import_rows import list_field
from conveyor.bench.trace.prefix_trie import PrefixTrie, shared_prefix
from conveyor.bench.trace.tokenizer_file import TokenCounter
from conveyor.bench.trace.traces import Trace, TraceError, TraceRequest, make_trace
from conveyor.bench.trace.wordlist import WORDS

DECODE_RETRIES = 10
N = TypeVar("N", int, float)


@dataclass(frozen=True)
class RandomParams:
    """vLLM's --random-* options."""

    input_len: int = 1024
    """--random-input-len: mean prompt tokens."""
    output_len: int = 128
    """--random-output-len: mean output tokens."""
    range_ratio: float = 0.0
    """--random-range-ratio r: lengths uniform in [len·(1−r), len·(1+r)], 0 <= r < 1."""
    prefix_len: int = 0
    """--random-prefix-len: tokens of one random prefix every request starts with."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.range_ratio < 1.0:
            raise TraceError(f"--random-range-ratio must be in [0, 1), got {self.range_ratio}")
        if self.input_len < 1 or self.output_len < 1 or self.prefix_len < 0:
            raise TraceError("--random-input-len and --random-output-len must be >= 1, --random-prefix-len >= 0")


class _Vocabulary:
    """Ids -> prompt text, and the count the server will see, with or without a tokenizer."""

    def __init__(self, counter: TokenCounter | None) -> None:
        self.counter = counter
        self.ids = np.asarray(counter.ordinary_ids() if counter else range(len(WORDS)))

    def text(self, ids: list[int]) -> str:
        return self.counter.decode(ids) if self.counter else " ".join(WORDS[i] for i in ids)

    def fit(self, ids: list[int], target: int, rng: np.random.Generator) -> tuple[str, int]:
        """(text, token count): vLLM's decode / re-encode / pad-or-cut loop towards target tokens."""
        if self.counter is None:
            return self.text(ids), len(ids)
        for _ in range(DECODE_RETRIES):
            ids = self.counter.encode(self.counter.decode(ids))
            if len(ids) == target:
                break
            if len(ids) < target:
                ids += self.ids[rng.integers(0, len(self.ids), size=target - len(ids))].tolist()
            else:
                ids = ids[:target]
        text = self.counter.decode(ids)
        return text, self.counter.count(text)


def _uniform_bounds(mean: int, ratio: float, floor_one: bool) -> tuple[int, int]:
    low, high = math.floor(mean * (1 - ratio)), math.ceil(mean * (1 + ratio))
    return (max(low, 1), max(high, 1)) if floor_one else (low, high)


def random_trace(p: RandomParams, num_requests: int, counter: TokenCounter | None, seed: int,
                 generator: JSONObject) -> Trace:
    """vLLM's random dataset as a trace (see the module docstring); the header's generator gets the seed and p."""
    rng = np.random.default_rng(seed)
    vocab = _Vocabulary(counter)
    in_low, in_high = _uniform_bounds(max(0, p.input_len - (counter.num_special_tokens if counter else 0)),
                                      p.range_ratio, floor_one=False)
    if p.prefix_len + in_low < 1:
        raise TraceError("--random-input-len is too small for this tokenizer's special tokens and range ratio")
    out_low, out_high = _uniform_bounds(p.output_len, p.range_ratio, floor_one=True)
    input_lens = rng.integers(in_low, in_high + 1, size=num_requests)
    output_lens = rng.integers(out_low, out_high + 1, size=num_requests)
    offsets = rng.integers(0, len(vocab.ids), size=num_requests)
    prefix = vocab.ids[rng.integers(0, len(vocab.ids), size=p.prefix_len)].tolist()
    requests = []
    for i in range(num_requests):
        body = vocab.ids[(int(offsets[i]) + i + np.arange(int(input_lens[i]))) % len(vocab.ids)].tolist()
        text, count = vocab.fit(prefix + body, p.prefix_len + int(input_lens[i]), rng)
        requests.append(TraceRequest(request_id=f"random-{i}", request_class="random", prompt=text, prompt_len=count,
                                     output_len=int(output_lens[i]), shared_prefix_len=p.prefix_len,
                                     prefix_group="random-prefix" if p.prefix_len else None))
    return make_trace(requests, seed=seed,
                      generator=dict(generator, seed=seed, random={"input_len": p.input_len, "output_len": p.output_len,
                                                        "range_ratio": p.range_ratio, "prefix_len": p.prefix_len}))


@dataclass(frozen=True)
class MooncakeSource:
    """A Mooncake-style trace file and how to expand it."""

    path: str
    """JSONL: timestamp (ms), input_length, output_length, hash_ids."""
    block_size: int = 512
    """Tokens per hash id."""
    seed: int = 0
    """Seed of the block contents."""
    num_requests: int | None = None
    """Keep the first N lines."""


@dataclass(frozen=True)
class MooncakeRow:
    """One line of a Mooncake trace, its fields checked."""

    line: int
    """Line number in the file (seeds the filler of a prompt longer than its blocks)."""
    timestamp_ms: float
    """Arrival, milliseconds."""
    input_length: int
    """Prompt tokens."""
    output_length: int
    """Output tokens, >= 1."""
    hash_ids: tuple[int, ...]
    """One id per block_size tokens of the prompt; equal ids, equal blocks."""


def _mooncake_row(row: JSON, where: str, line: int) -> MooncakeRow:
    fields = row if isinstance(row, dict) else {}
    missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in fields]
    hash_ids = list_field(fields, "hash_ids")
    if missing or hash_ids is None or _number(fields["output_length"], "output_length", where, int) < 1:
        raise TraceError(f"{where}: a Mooncake line needs timestamp, input_length, output_length >= 1 "
                         f"and a hash_ids list (missing: {', '.join(missing) or 'none'})")
    return MooncakeRow(line=line, timestamp_ms=_number(fields["timestamp"], "timestamp", where, float),
                       input_length=_number(fields["input_length"], "input_length", where, int),
                       output_length=_number(fields["output_length"], "output_length", where, int),
                       hash_ids=tuple(_number(h, "hash_ids", where, int) for h in hash_ids))


def _number(value: JSON, name: str, where: str, kind: Callable[[int | float | str], N]) -> N:
    """int() or float() as the reader always applied them; a TraceError naming the field rather than a crash."""
    try:
        if isinstance(value, (int, float, str)):
            return kind(value)
    except (ValueError, OverflowError):
        pass
    raise TraceError(f"{where}: {name} must be a number, got {value!r}")


def _mooncake_rows(src: MooncakeSource) -> list[MooncakeRow]:
    p = pathlib.Path(src.path)
    if not p.is_file():
        raise TraceError(f"input file {p} does not exist")
    rows = []
    for lineno, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            rows.append(_mooncake_row(json.loads(line), f"{p}:{lineno}", lineno))
    if not rows:
        raise TraceError(f"{p}: no requests in the trace")
    return rows[: src.num_requests] if src.num_requests else rows


def _block(src: MooncakeSource, vocab: _Vocabulary, key: tuple[int, ...]) -> list[int]:
    picks = np.random.default_rng([src.seed, *key]).integers(0, len(vocab.ids), size=src.block_size)
    return [int(i) for i in vocab.ids[picks]]


def _mooncake_ids(src: MooncakeSource, vocab: _Vocabulary, row: MooncakeRow) -> list[int]:
    """The prompt: the blocks of its hash ids (the last one cut), padded with its own ids if they run short."""
    remaining, ids = row.input_length, []
    for h in row.hash_ids:
        take = min(src.block_size, remaining)
        ids += _block(src, vocab, (0, h))[:take]
        remaining -= take
        if remaining <= 0:
            break
    while remaining > 0:  # more tokens than blocks listed: unique filler
        ids += _block(src, vocab, (1, row.line, remaining))[: min(src.block_size, remaining)]
        remaining = row.input_length - len(ids)
    return ids


def mooncake_trace(src: MooncakeSource, counter: TokenCounter | None, generator: JSONObject) -> Trace:
    rows = sorted(_mooncake_rows(src), key=lambda r: r.timestamp_ms)
    vocab, trie = _Vocabulary(counter), PrefixTrie()
    paths = [trie.insert(list(r.hash_ids)) for r in rows]
    t0 = rows[0].timestamp_ms
    requests = []
    for k, (row, path) in enumerate(zip(rows, paths)):
        ids, blocks = _mooncake_ids(src, vocab, row), shared_prefix(trie, path)
        text = {"prompt_token_ids": ids} if counter else {"prompt": vocab.text(ids)}
        requests.append(TraceRequest(
            request_id=f"r{k:06d}", request_class="mooncake", prompt_len=len(ids), output_len=row.output_length,
            arrival_s=round((row.timestamp_ms - t0) / 1000.0, 6),
            shared_prefix_len=min(blocks * src.block_size, len(ids)),
            prefix_group=f"p{path[blocks - 1]}" if blocks else None, **text))
    return make_trace(requests, seed=src.seed, generator=dict(generator, block_size=src.block_size))
