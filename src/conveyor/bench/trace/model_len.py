"""Fit a trace to the target server's max_model_len (`trace make | import --max-model-len N`).

A request whose prompt plus requested output exceeds the server's max_model_len is refused (HTTP 400, as
vLLM does) and counts as a client-side error that invalidates the run, so a trace meant for a server
must fit it. As `vllm bench serve` (which drops ShareGPT prompts over its length limits) the fit is the
trace maker's job, never the load generator's: the trace on disk is exactly what is sent.

Two steps. Before generation the synthetic classes' length ranges are narrowed so every chat and long
request fits by construction (the counts and the mix stay as asked). After generation (and after exact
lengths from --tokenize-url, if given) every request is checked as it will be sent: a session turn
carries the whole conversation before it (earlier inputs and full answers, load/sessions.py), so a turn
that cannot fit ends its session there (it and its later turns are dropped, as is a standalone prompt that
cannot fit: an imported log may hold one); a request whose prompt fits but whose output does not gets its
output clipped. TOKEN_MARGIN and TURN_MARGIN leave room for what the
trace's word counts do not see (BOS, chat-template role markers, the separator between turns).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from conveyor.bench.trace.trace_gen import TraceMakeConfig
from conveyor.bench.trace.traces import Trace, TraceRequest, make_trace

TOKEN_MARGIN = 8
"""Tokens kept free in every request: a BOS token and a chat template's markers around one message."""
TURN_MARGIN = 4
"""Tokens kept free per earlier turn of a session: its role markers and the separator after its answer."""
MIN_MODEL_LEN = 256
"""Below this no class keeps a meaningful shape (an agent's system prompt alone is 256 tokens)."""


@dataclass(frozen=True)
class FitReport:
    """What fitting changed."""

    max_model_len: int
    """The bound."""
    num_dropped: int = 0
    """Requests dropped: a prompt that cannot fit (a session turn: it and its later turns)."""
    num_clipped: int = 0
    """Requests whose output_len was cut so prompt + output fits."""

    def describe(self) -> str:
        return (f"fitted to max_model_len {self.max_model_len}: {self.num_clipped} outputs clipped, "
                f"{self.num_dropped} requests dropped")


def fit_config(cfg: TraceMakeConfig, max_model_len: int) -> TraceMakeConfig:
    """The synthetic classes' ranges narrowed so chat, long and an agent session's first turn fit."""
    if max_model_len < MIN_MODEL_LEN:
        raise ValueError(f"--max-model-len {max_model_len} is below {MIN_MODEL_LEN}: too small for the synthetic "
                         "classes")
    budget = max_model_len - TOKEN_MARGIN
    chat = dataclasses.replace(cfg.chat, prompt_len_max=min(cfg.chat.prompt_len_max,
                                                            budget - cfg.chat.output_len_max))
    long_max = min(cfg.long.prompt_len_max, budget - cfg.long.output_len_max)
    long = dataclasses.replace(cfg.long, prompt_len_max=long_max, prompt_len_min=min(cfg.long.prompt_len_min, long_max))
    a = cfg.agent
    room = budget - a.system_prompt_len - a.question_len_max - a.output_len_max
    agent = dataclasses.replace(a, documents_len=max(0, min(a.documents_len, room)))
    if min(chat.prompt_len_max, long.prompt_len_max) < 4:
        raise ValueError(f"--max-model-len {max_model_len} leaves no room for prompts after the outputs "
                         "(lower chat/long output_len_max with --param)")
    return dataclasses.replace(cfg, chat=chat, long=long, agent=agent)


def fit_requests(requests: Sequence[TraceRequest], max_model_len: int) -> tuple[list[TraceRequest], FitReport]:
    """Every request fitted as it will be sent (see the module docstring); order is kept."""
    budget = max_model_len - TOKEN_MARGIN
    history: dict[str, int] = {}
    ended: set[str] = set()
    out: list[TraceRequest] = []
    dropped = clipped = 0
    for req in requests:
        session = str(req.session_id) if req.turn is not None else None
        if session in ended:
            dropped += 1
            continue
        sent = req.prompt_len + (history.get(session, 0) + TURN_MARGIN if session and req.turn else 0)
        if sent + 1 > budget:  # not even one output token fits
            if session is not None:
                ended.add(session)
            dropped += 1
            continue
        if sent + req.output_len > budget:
            req, clipped = dataclasses.replace(req, output_len=budget - sent), clipped + 1
        if session is not None:
            history[session] = sent + req.output_len
        out.append(req)
    return out, FitReport(max_model_len, dropped, clipped)


def fit_trace(trace: Trace, max_model_len: int) -> tuple[Trace, FitReport]:
    """The trace fitted, its header recording the bound (a new version when anything changed)."""
    requests, report = fit_requests(trace.requests, max_model_len)
    generator = dict(trace.header.generator, max_model_len=max_model_len)
    return make_trace(requests, seed=trace.header.seed, generator=generator), report
