"""The front end's share of TTFT, fitted from a measured run: what the step log cannot see.

A client's TTFT is the engine's time from a request reaching its scheduler to the first token's step end,
plus two stretches outside the engine: the way in (HTTP, tokenizing, the hop to the engine core) and the
way out (detokenizing, the first SSE chunk to the client). On the session-13 H100 logs the step-log twin
was 21-29% low on p95 TTFT, and the step log itself showed why: requests reached the scheduler late
(most by a few ms, some by several steps: the API server was busy streaming), and the client saw each
first token ~18 ms after its step ended (docs/performance.md, "The front end in the twin").

The fit needs what the run had: its step log (with start_s and end_s), the trace it sent (send times and
prompt lengths, in order) and the client's mean TTFT. Requests are matched to steps first come, first
served: a step with k prefill requests takes the next k (a chunked prompt goes on in the next step), so
each request's first prefill step and first-token step are known. Then:
- the way in, per request: how late it reached the scheduler at least. A request that reaches it before
  step k's update ends is scheduled into step k + 1, or k + 2 with async scheduling (the next step is
  already launched); one first scheduled in step a reached it after step a - 2's (a - 3's) update ended.
  The distribution of these lower bounds is kept as quantiles; the simulation draws one per request.
- the way out: the client's mean TTFT minus the mean of (first-token step end - send time). The clocks are
  joined at the first request, taken to reach the scheduler as the first step starts, so its own way in
  is counted here too.
"""

from __future__ import annotations

import json
import pathlib
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from conveyor.bench.jsonvalue import JSON
from conveyor.bench.trace.traces import TraceError, read_trace

NUM_QUANTILES = 51
"""In-delay quantiles kept (every 2%): the tail that sets p95 TTFT needs more than a mean."""


class FrontEndError(ValueError):
    """A run the front end cannot be fitted from (the message names what is missing)."""


@dataclass(frozen=True)
class LoggedStep:
    """The parts of a step-log record the matching needs."""

    num_prefill_reqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class FrontEndRun:
    """One measured run: its step log, the prompts it sent in order, and what the client measured."""

    steps: tuple[LoggedStep, ...]
    send_s: tuple[float, ...]
    """Each request's send time (any origin), ascending."""
    prompt_lens: tuple[int, ...]
    client_mean_ttft_s: float
    async_scheduling: bool


@dataclass(frozen=True)
class FrontEnd:
    """The fitted front end: a drawn delay on the way in, a constant on the way out."""

    in_delay_s: tuple[float, ...]
    """Quantiles (evenly spaced from 0 to 1, ascending, >= 0) of the time from send to the scheduler."""
    out_s: float
    """Added to every streamed chunk: from the step's end to the client."""
    num_requests: int
    """Requests it was fitted on."""

    def __post_init__(self) -> None:
        if len(self.in_delay_s) < 2 or list(self.in_delay_s) != sorted(self.in_delay_s) or self.in_delay_s[0] < 0:
            raise ValueError("front_end in_delay_s must be two or more ascending numbers >= 0")
        if not self.out_s >= 0:
            raise ValueError(f"front_end out_s must be >= 0 (got {self.out_s})")

    def to_json(self) -> dict[str, JSON]:
        return {"in_delay_s": list(self.in_delay_s), "out_s": self.out_s, "num_requests": self.num_requests}

    @classmethod
    def from_json(cls, value: JSON, where: str) -> FrontEnd:
        if not isinstance(value, dict):
            raise ValueError(f"{where}: front_end must be an object")
        delays, out, count = value.get("in_delay_s"), value.get("out_s"), value.get("num_requests", 0)
        numbers = [d for d in delays if isinstance(d, (int, float))] if isinstance(delays, list) else []
        if not isinstance(delays, list) or len(numbers) != len(delays) or isinstance(out, bool) \
                or not isinstance(out, (int, float)) or not isinstance(count, int):
            raise ValueError(f"{where}: front_end needs in_delay_s (numbers), out_s (a number), num_requests")
        try:
            return cls(tuple(float(d) for d in numbers), float(out), count)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None


def match_prefills(steps: Sequence[LoggedStep], prompt_lens: Sequence[int]) -> tuple[list[int], list[int]]:
    """Each request's first prefill step and its first-token step (indices into `steps`), first come, first
    served; requests the log never finished are left out (both lists stop there). A step ends a request's
    prompt unless it ran at the token budget (taken as the largest step logged) short of the prompts (a
    chunk); the server re-tokenizes and its prefix cache hits, so a logged length is not matched exactly."""
    budget = max((s.num_prefill_tokens + s.num_decode_tokens for s in steps), default=0)
    first: list[int] = []
    last: list[int] = []
    for k, step in enumerate(steps):
        ids = range(len(last), min(len(last) + step.num_prefill_reqs, len(prompt_lens)))
        first.extend(k for _ in range(len(first), ids.stop))
        chunked = step.num_prefill_tokens + step.num_decode_tokens >= budget and \
            sum(prompt_lens[i] for i in ids) > step.num_prefill_tokens + 16
        last.extend(k for _ in (ids[:-1] if chunked else ids))
    return first[:len(last)], last


def fit_front_end(runs: Sequence[FrontEndRun]) -> FrontEnd:
    """The front end of `runs` pooled (module docstring): in-delay quantiles and the out constant."""
    delays: list[float] = []
    outs: list[tuple[float, int]] = []
    for run in runs:
        first, last = match_prefills(run.steps, run.prompt_lens)
        if not last:
            raise FrontEndError("no request could be matched to the step log (is it the run's log?)")
        ends = [s.end_s for s in run.steps]
        offset = run.steps[0].start_s - run.send_s[0]
        lag = 2 if run.async_scheduling else 1
        arrive = [offset + run.send_s[j] for j in range(len(last))]
        delays += [max(0.0, ends[a - lag - 1] - t) if a > lag else 0.0 for a, t in zip(first, arrive)]
        engine = statistics.fmean(ends[k] - t for k, t in zip(last, arrive))
        outs.append((run.client_mean_ttft_s - engine, len(last)))
    total = sum(n for _, n in outs)
    out_s = max(0.0, sum(o * n for o, n in outs) / total)
    return FrontEnd(_quantiles(delays), out_s, total)


def _quantiles(values: Sequence[float]) -> tuple[float, ...]:
    ordered = sorted(values)
    return tuple(ordered[round(i * (len(ordered) - 1) / (NUM_QUANTILES - 1))] for i in range(NUM_QUANTILES))


def read_front_end_run(step_log: list[dict[str, JSON]], trace_path: pathlib.Path, client_path: pathlib.Path,
                       async_scheduling: bool) -> FrontEndRun:
    """A run from its step-log rows, its trace file and the client's result JSON (`vllm bench serve
    --save-result`, or a run's summary.json: both give mean_ttft_ms)."""
    try:
        requests = sorted(read_trace(trace_path, verify=False).requests, key=lambda r: r.arrival_s or 0.0)
        client = json.loads(client_path.read_text(encoding="utf-8"))
    except (OSError, ValueError, TraceError) as error:
        raise FrontEndError(f"cannot read {error}") from None
    mean_ms = client.get("mean_ttft_ms") if isinstance(client, dict) else None
    if not isinstance(mean_ms, (int, float)) or isinstance(mean_ms, bool):
        raise FrontEndError(f"{client_path}: no mean_ttft_ms (the client's result JSON gives it)")
    try:
        steps = tuple(LoggedStep(int(r["num_prefill_reqs"]), int(r["num_prefill_tokens"]),  # type: ignore[arg-type]
                                 int(r["num_decode_tokens"]), float(r["start_s"]), float(r["end_s"]))  # type: ignore[arg-type]
                      for r in step_log)
    except (KeyError, TypeError, ValueError):
        raise FrontEndError("its step log needs num_prefill_reqs, num_prefill_tokens, num_decode_tokens, "
                            "start_s and end_s in every record") from None
    if not steps or not requests:
        raise FrontEndError("an empty step log or trace")
    return FrontEndRun(steps, tuple(r.arrival_s or 0.0 for r in requests), tuple(r.prompt_len for r in requests),
                       float(mean_ms) / 1e3, async_scheduling)
