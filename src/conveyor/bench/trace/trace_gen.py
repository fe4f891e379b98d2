"""Synthetic trace generators: `chat`, `long` and `agent`, mixed and stamped with arrival times.

Each class has its own parameter dataclass and its own numpy Generator (seeded from the trace seed and
the class name), so changing the share of one class does not reshuffle the others' requests. Chat and
long text is drawn from wordlist.WORDS, whose words are one token each after a space, so a prompt of n
words is ≈ n tokens (exactly n for SmolLM2's tokenizer, ±1 for the first word; docs/trace-format.md).
`agent` models agent/RAG traffic as sessions (traces.py): every session starts with one system prompt
shared by all agent traffic (prefix_group / shared_prefix_len) and its own retrieved documents and
task, natural text from agent_corpus.py whose token counts it carries; each later turn (a tool result
or follow-up) is sent after the previous answer plus a think time, with the whole history before it,
so the prefix a turn shares with its session grows. A share of turns are copy tasks (agent_tasks.py:
quote a passage, edit code, fill JSON) whose answers repeat the prompt: n-gram speculation's best case.
Outputs vary widely and a share of turns is cancelled (after a delay or after N tokens). When the
trace is stamped with arrival times only a session's first turn gets one.
"""

from __future__ import annotations

import enum
import itertools
import math
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from conveyor.bench.jsonvalue import JSON
from conveyor.bench.trace.agent_corpus import INSTRUCTIONS, PROSE, Passage
from conveyor.bench.trace.agent_tasks import SEPARATOR, SEPARATOR_TOKENS, CopyTask, copy_task
from conveyor.bench.trace.arrivals import ArrivalConfig, send_offsets_s
from conveyor.bench.trace.traces import Trace, TraceRequest, make_trace
from conveyor.bench.trace.wordlist import WORDS


@dataclass(frozen=True)
class ChatParams:
    """Short prompts, short answers (lognormal lengths, clipped)."""

    prompt_len_median: int = 64
    """Median prompt tokens."""
    prompt_len_max: int = 512
    """Prompt tokens are clipped to [4, this]."""
    output_len_median: int = 48
    """Median output tokens."""
    output_len_max: int = 256
    """Output tokens are clipped to [4, this]."""
    sigma: float = 0.6
    """Lognormal shape of both lengths."""


@dataclass(frozen=True)
class LongParams:
    """Large prefills (documents to summarize), moderate outputs (uniform lengths)."""

    prompt_len_min: int = 1500
    """Smallest prompt, tokens."""
    prompt_len_max: int = 3000
    """Largest prompt, tokens (keep below the server's max_model_len minus output_len_max)."""
    output_len_min: int = 32
    """Smallest output, tokens."""
    output_len_max: int = 160
    """Largest output, tokens."""


@dataclass(frozen=True)
class AgentParams:
    """Multi-turn sessions over a shared system prompt and retrieved documents; many turns copy from the prompt."""

    system_prompt_len: int = 256
    """Tokens of the system prompt every agent session starts with (shared by all agent traffic): the
    assistant's instructions (agent_corpus.INSTRUCTIONS), cut to this length."""
    documents_len: int = 1024
    """Tokens of retrieved documents in a session's first turn (its own): natural passages
    (agent_corpus.PROSE) in a random order, the last one cut to this length."""
    question_len_min: int = 16
    """Shortest question / tool-result input of a turn that is not a copy task, tokens."""
    question_len_max: int = 96
    """Longest such input, tokens."""
    turns_mean: float = 3.0
    """Mean turns per session (1 + Poisson)."""
    think_time_s_mean: float = 0.5
    """Mean pause between an answer and the session's next turn (exponential): tool calls, reading."""
    copy_fraction: float = 0.5
    """Share of turns that are copy tasks (quote a passage, edit code, fill JSON; equally likely)."""
    copy_len_median: int = 64
    """Median tokens a JSON fill task copies (lognormal, sigma 0.5, clipped to [8, output_len_max]); a
    quote copies one passage (44-55 tokens), an edit one program (38-48)."""
    output_len_median: int = 96
    """Median output tokens of the other turns (lognormal, sigma 1: highly variable)."""
    output_len_max: int = 512
    """Output tokens are clipped to [4, this]."""
    cancel_fraction: float = 0.15
    """Share of agent turns the client cancels; half after a delay, half after N tokens."""
    cancel_after_s_max: float = 2.0
    """Delay cancellations are uniform in [0.2, this] seconds."""
    cancel_after_tokens_max: int = 32
    """Token cancellations are uniform in [2, this] streamed chunks."""


@dataclass(frozen=True)
class TraceMakeConfig:
    """Everything `conveyor trace make` needs; recorded in the trace header."""

    mix: dict[str, float] = field(default_factory=lambda: {"chat": 0.6, "long": 0.2, "agent": 0.2})
    """Class -> share (normalized)."""
    num_requests: int | None = 100
    """Number of requests (or None with duration_s)."""
    duration_s: float | None = None
    """Generate the requests that arrive within this many seconds (needs a finite arrival rate)."""
    seed: int = 0
    """Seed of every generator."""
    arrival: ArrivalConfig | None = None
    """Stamp arrival_s on each request with this process; None leaves the trace untimed."""
    chat: ChatParams = ChatParams()
    """chat class parameters."""
    long: LongParams = LongParams()
    """long class parameters."""
    agent: AgentParams = AgentParams()
    """agent class parameters."""


CLASSES = ("chat", "long", "agent")


def words(rng: np.random.Generator, num_words: int) -> list[str]:
    idx = rng.integers(0, len(WORDS), size=num_words)
    return [WORDS[i] for i in idx]


def _lognormal_len(rng: np.random.Generator, median: int, sigma: float, max_len: int) -> int:
    return int(np.clip(round(median * math.exp(sigma * rng.standard_normal())), 4, max_len))


def _class_rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def gen_chat(p: ChatParams, n: int, rng: np.random.Generator) -> list[TraceRequest]:
    out = []
    for i in range(n):
        plen = _lognormal_len(rng, p.prompt_len_median, p.sigma, p.prompt_len_max)
        olen = _lognormal_len(rng, p.output_len_median, p.sigma, p.output_len_max)
        out.append(TraceRequest(request_id=f"chat-{i}", request_class="chat", prompt=" ".join(words(rng, plen)),
                                prompt_len=plen, output_len=olen))
    return out


def gen_long(p: LongParams, n: int, rng: np.random.Generator) -> list[TraceRequest]:
    out = []
    for i in range(n):
        plen = int(rng.integers(p.prompt_len_min, p.prompt_len_max + 1))
        olen = int(rng.integers(p.output_len_min, p.output_len_max + 1))
        out.append(TraceRequest(request_id=f"long-{i}", request_class="long", prompt=" ".join(words(rng, plen)),
                                prompt_len=plen, output_len=olen))
    return out


def gen_agent(p: AgentParams, n: int, rng: np.random.Generator) -> list[TraceRequest]:
    """n agent turns, as sessions of 1 + Poisson(turns_mean - 1) turns (the last one cut to fit n)."""
    system = _join(_take(itertools.cycle(INSTRUCTIONS), p.system_prompt_len))
    out: list[TraceRequest] = []
    session = 0
    while len(out) < n:
        num_turns = min(n - len(out), 1 + int(rng.poisson(max(p.turns_mean - 1.0, 0.0))))
        documents = _take(_shuffled_forever(PROSE, rng), p.documents_len)
        for k in range(num_turns):
            prefix = [system, _join(documents)] if k == 0 else []
            out.append(_agent_turn(p, rng, (len(out), session, k), prefix, documents))
        session += 1
    return out


def _shuffled_forever(pool: tuple[Passage, ...], rng: np.random.Generator) -> Iterator[Passage]:
    while True:
        yield from (pool[int(i)] for i in rng.permutation(len(pool)))


def _take(passages: Iterator[Passage], num_tokens: int) -> list[Passage]:
    """Passages in order until they hold num_tokens; the last one is cut by words to end close to it."""
    taken: list[Passage] = []
    total = 0
    while total < num_tokens:
        passage = next(passages)
        room = num_tokens - total - (SEPARATOR_TOKENS if taken else 0)
        if room <= 0:
            break
        if passage.num_tokens > room:
            words = passage.text.split()
            keep = max(1, round(room * len(words) / passage.num_tokens))
            passage = Passage(" ".join(words[:keep]), max(1, round(passage.num_tokens * keep / len(words))))
        taken.append(passage)
        total += passage.num_tokens + (SEPARATOR_TOKENS if len(taken) > 1 else 0)
    return taken


def _join(passages: list[Passage]) -> Passage:
    """The passages as one text, SEPARATOR between them, and its token count."""
    return Passage(SEPARATOR.join(p.text for p in passages),
                   sum(p.num_tokens for p in passages) + SEPARATOR_TOKENS * max(len(passages) - 1, 0))


def _agent_turn(p: AgentParams, rng: np.random.Generator, ids: tuple[int, int, int], prefix: list[Passage],
                documents: list[Passage]) -> TraceRequest:
    """Turn k of a session: its own input after `prefix` (the system prompt and documents on turn 0)."""
    i, session, k = ids
    if rng.random() < p.copy_fraction:
        kind = list(CopyTask)[int(rng.integers(0, len(CopyTask)))]
        copy_len = int(np.clip(round(p.copy_len_median * math.exp(0.5 * rng.standard_normal())), 8, p.output_len_max))
        task = copy_task(kind, documents, copy_len, rng)
        own, output_len = Passage(task.text, task.num_tokens), min(task.copy_len, p.output_len_max)
    else:
        num_words = int(rng.integers(p.question_len_min, p.question_len_max + 1))
        own = Passage(" ".join(words(rng, num_words)), num_words)
        output_len = _lognormal_len(rng, p.output_len_median, 1.0, p.output_len_max)
    cancel_s, cancel_tokens = None, None
    if rng.random() < p.cancel_fraction:
        if rng.random() < 0.5:
            cancel_s = round(float(rng.uniform(0.2, p.cancel_after_s_max)), 3)
        else:
            cancel_tokens = int(rng.integers(2, p.cancel_after_tokens_max + 1))
    prompt = _join([*prefix, own])
    return TraceRequest(
        request_id=f"agent-{i}", request_class="agent", prompt=prompt.text, prompt_len=prompt.num_tokens,
        output_len=output_len, prefix_group="agent-system" if k == 0 else None,
        shared_prefix_len=prefix[0].num_tokens if prefix else 0, cancel_after_s=cancel_s,
        cancel_after_tokens=cancel_tokens, session_id=f"agent-s{session}", turn=k,
        think_time_s=round(float(rng.exponential(p.think_time_s_mean)), 3) if k else None)


def _num_and_offsets(cfg: TraceMakeConfig) -> tuple[int, list[float] | None]:
    if cfg.duration_s is not None:
        if cfg.arrival is None or math.isinf(cfg.arrival.request_rate):
            raise ValueError("--duration needs a finite --rate to know how many requests arrive in it")
        guess = int(cfg.arrival.request_rate * cfg.duration_s * 2 + 100)
        within = [t for t in send_offsets_s(cfg.arrival, guess) if t < cfg.duration_s]
        return len(within), within
    if cfg.num_requests is None or cfg.num_requests < 1:
        raise ValueError("--num-requests must be >= 1 (or give --duration)")
    offsets = send_offsets_s(cfg.arrival, cfg.num_requests) if cfg.arrival is not None else None
    return cfg.num_requests, offsets


def make_mixed_trace(cfg: TraceMakeConfig) -> Trace:
    """Draw the class of each slot from the mix, fill slots from each class's generator, stamp arrivals."""
    unknown = set(cfg.mix) - set(CLASSES)
    if unknown or not cfg.mix or any(v < 0 for v in cfg.mix.values()) or sum(cfg.mix.values()) <= 0:
        raise ValueError(f"--mix must give non-negative shares of {', '.join(CLASSES)} (got {cfg.mix})")
    n, offsets = _num_and_offsets(cfg)
    names = sorted(cfg.mix)
    probs = np.array([cfg.mix[c] for c in names]) / sum(cfg.mix.values())
    slots = [names[i] for i in _class_rng(cfg.seed, "mix").choice(len(names), size=n, p=probs)]
    pools = {
        "chat": iter(gen_chat(cfg.chat, slots.count("chat"), _class_rng(cfg.seed, "chat"))),
        "long": iter(gen_long(cfg.long, slots.count("long"), _class_rng(cfg.seed, "long"))),
        "agent": iter(gen_agent(cfg.agent, slots.count("agent"), _class_rng(cfg.seed, "agent"))),
    }
    requests = [next(pools[c]) for c in slots]
    if offsets is not None:
        requests = _stamp(requests, offsets)
    requests = [replace(r, request_id=f"r{i:06d}-{r.request_class}") for i, r in enumerate(requests)]
    generator = {"name": "mix", "config": _jsonable(asdict(cfg))}
    return make_trace(requests, seed=cfg.seed, generator=generator)


def _stamp(requests: list[TraceRequest], offsets: list[float]) -> list[TraceRequest]:
    """Arrival times from the process on standalone requests and session starts; a later turn has none (it
    follows its answer) and is written right after its session's previous turn."""
    start_of: dict[str, float] = {}
    keyed: list[tuple[tuple[float, int], TraceRequest]] = []
    for r, t in zip(requests, offsets):
        if r.turn:
            keyed.append(((start_of[str(r.session_id)], r.turn), r))
            continue
        t = round(t, 6)
        if r.turn == 0:
            start_of[str(r.session_id)] = t
        keyed.append(((t, 0), replace(r, arrival_s=t)))
    return [r for _, r in sorted(keyed, key=lambda kr: kr[0])]


def _jsonable(value: object) -> JSON:
    """The config as the header's JSON: enums by value, an infinite rate as "inf"."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, enum.Enum):
        return _jsonable(value.value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(f"trace config value {value!r} has no JSON form")
