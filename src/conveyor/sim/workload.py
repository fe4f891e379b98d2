"""A conveyor trace as the simulation's requests: due times as `bench run` draws them, prompts as tokens.

Due times: the same dispatch units (`traces.dispatch_units`: standalone requests and each session's first
turn) and the same arrival draws (`load/profiles.resolve_load`, `trace/arrivals.send_offsets_s`) as
`conveyor bench run` with the same --rate, --arrival, --burstiness, --time-scale and --seed, so a replay
sends each request when the measured run did (give or take the client's send lag); a --max-concurrency
cap (or a closed-loop --profile) holds a due request until a slot frees, as bench's slot gate does.

Prompts: the simulation needs token ids, so that the real prefix cache hits exactly where the server's
would. A trace's own `prompt_token_ids` are used as they are. Otherwise the prompt is `prompt_len` tokens
(the trace's count) drawn from a seeded generator: the first `shared_prefix_len` from one keyed by the
request's `prefix_group` (so a group shares them block for block, as its shared system prompt and
documents do on the server), the rest from one keyed by the request id (so nothing else is shared).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from conveyor.bench.load.profiles import LoadFlags, LoadProfile, LoadShape, resolve_load
from conveyor.bench.trace.arrivals import ArrivalProcess, send_offsets_s
from conveyor.bench.trace.traces import Trace, TraceRequest, dispatch_units
from conveyor.core.trace_sim import SimRequest

_VOCAB = range(1000, 31000)
"""Token ids the synthetic prompts draw from (clear of small special ids such as an EOS)."""


@dataclass(frozen=True)
class LoadSettings:
    """`bench run`'s load-shape flags, as the simulation takes them."""

    request_rate: float
    """Dispatch units per second (math.inf: all at once)."""
    arrival: str | None = None
    """poisson | gamma | constant | replay (None: poisson)."""
    burstiness: float = 1.0
    time_scale: float = 1.0
    seed: int = 0
    num_requests: int | None = None
    """Only the first N requests of the trace."""
    profile: str | None = None
    """GuideLLM's profile name, as the run gave it."""
    max_concurrency: int | None = None
    """The client's in-flight cap (--max-concurrency; closed-loop profiles set one)."""

    def shape(self) -> LoadShape:
        """The arrival process and cap, resolved by bench's own rules (LoadProfileError names a flag)."""
        return resolve_load(LoadFlags(
            profile=None if self.profile is None else LoadProfile(self.profile), request_rate=self.request_rate,
            arrival=None if self.arrival is None else ArrivalProcess(self.arrival), max_concurrency=self.max_concurrency,
            burstiness=self.burstiness, time_scale=self.time_scale, seed=self.seed))


def due_times(trace: Trace, load: LoadSettings) -> tuple[list[TraceRequest], list[list[TraceRequest]], list[float]]:
    """(requests sent, dispatch units, each unit's due time) exactly as `bench run` plans them."""
    requests = trace.requests[: load.num_requests] if load.num_requests else trace.requests
    units = dispatch_units(requests)
    return requests, units, send_offsets_s(load.shape().arrival, len(units), [u[0].arrival_s for u in units])


def sim_requests(trace: Trace, load: LoadSettings) -> list[SimRequest]:
    """Every request of the trace (its first `num_requests`), in tokens, turn 0 of a session with its due time."""
    _, units, offsets = due_times(trace, load)
    out = []
    for unit, offset_s in zip(units, offsets):
        for index, request in enumerate(unit):
            out.append(SimRequest(
                request.request_id, request.request_class, prompt_tokens(request), request.output_len,
                offset_s if index == 0 else None, request.cancel_after_s, request.cancel_after_tokens,
                request.session_id, request.turn, request.think_time_s or 0.0))
    return out


def prompt_tokens(request: TraceRequest) -> tuple[int, ...]:
    """The request's prompt (for a session turn, its new input) as token ids (module docstring)."""
    if request.prompt_token_ids is not None:
        return tuple(request.prompt_token_ids)
    length = max(request.prompt_len, 1)  # a server prompt has at least one token
    shared = min(request.shared_prefix_len, length) if request.prefix_group is not None else 0
    head = random.Random(f"group:{request.prefix_group}").choices(_VOCAB, k=shared) if shared else []
    tail = random.Random(f"request:{request.request_id}").choices(_VOCAB, k=length - shared)
    return tuple(head + tail)
