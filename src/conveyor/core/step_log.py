"""The step log: what each engine step computed, and how long it took (the input of a step-time model).

One `StepRecord` per engine step, built from the step's `SchedulerOutput` and `SchedulerStats`: the
batch's composition (prefill and decode tokens and sequences, context tokens attended, draft tokens,
preemptions) and its wall time. A request counts as prefill when it enters the worker this step (a new
or resumed request) or computes more than one token besides its drafts (a prefill chunk); every other
scheduled request is a decode. So a last prefill chunk of exactly one token counts as a decode: the
scheduler's output does not carry prompt lengths, and the cost of such a step is a decode's anyway.

How a step's time is taken. A step's time is what the engine spent on that step, so that the simulation,
which prices one step after another, adds up to the engine's busy time. Two invariants hold:
- The records tile the engine's busy time: over a run of steps, the sum of `step_time_s` is the wall time
  spent inside the engine's steps, each instant counted once (the loop's time between steps is apart:
  the calibration measures it from `start_s` and `end_s`).
- Each step carries its own host work: its schedule, input preparation and launch.
A synchronous step (`EngineCore`) is one span: from its schedule's start to its update's end. An async
step (`AsyncEngineCore`) is two: the engine schedules and launches step N+1 before it collects step N, so
N's time is its launch (schedule + prepare + launch of N, `launch_time_s`) plus its settle (from the end
of N+1's launch to the end of N's update: the wait for N's tokens and the update). N+1's launch, which
happens between the two, is N+1's. Timing N from N+1's schedule instead (the logs written before this
rule) charged a big prefill's launch to the decode step before it, and the prefill then logged a few ms.
What no rule can split: the device runs N while the host launches N+1, and that time is in N+1's record.
In steady state N's wait is its device time less N+1's launch, so a record is about the step's period;
a decode before a launch longer than its device work logs little more than its own host work (the
device was otherwise idle: the pair's sum is still the pair's cost).
A launch that must wait for the step in flight (penalties and grammars read its token) carries that wait.
An empty step (nothing computed) is not logged, and its time with it.

`StepLog` is a bounded ring (`--step-log-size N`): the newest N records, drained by whoever collects
them. The engine holds None when the log is off, so the cost of an unlogged step is one branch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, fields

from conveyor.core.outputs import SchedulerOutput
from conveyor.core.stats import SchedulerStats


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """One engine step's batch and wall time. Keywords only: seven ints in a row are easy to swap."""

    num_prefill_tokens: int
    """Tokens computed for requests in their prefill phase (prefix-cache hits excluded)."""
    num_decode_tokens: int
    """Tokens computed for requests in their decode phase, their draft tokens included."""
    num_prefill_reqs: int
    """Requests in their prefill phase (a chunk, a new request, a resumed one)."""
    num_decode_reqs: int
    """Requests in their decode phase."""
    num_context_tokens: int
    """Sum over scheduled requests of num_computed_tokens + scheduled tokens: the KV the step's attention reads."""
    num_draft_tokens: int = 0
    """Speculative draft tokens verified (already counted in num_decode_tokens)."""
    num_preemptions: int = 0
    """Requests preempted while this step was scheduled."""
    step_time_s: float = 0.0
    """Wall time of schedule + execute + update (monotonic clock); async: launch + settle (module docstring)."""
    start_s: float = 0.0
    """time.monotonic() when the step began (orders records; CLOCK_MONOTONIC is shared by a host's processes)."""
    launch_time_s: float = 0.0
    """Of step_time_s, the schedule + prepare + launch, timed apart under async scheduling (0: a synchronous
    step, or a log written before the field)."""
    end_s: float = 0.0
    """time.monotonic() when the step's update ended (0: a log written before the field)."""

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def num_reqs(self) -> int:
        return self.num_prefill_reqs + self.num_decode_reqs

    def to_json(self) -> dict[str, int | float]:
        """One JSON object (a line of step_log.jsonl)."""
        return asdict(self)

    @classmethod
    def from_json(cls, value: dict[str, object]) -> StepRecord:
        """The inverse of `to_json`; unknown keys are ignored so that older readers accept newer logs."""
        known = {f.name for f in fields(cls)}
        kwargs: dict[str, int | float] = {}
        for name, raw in value.items():
            if name in known and isinstance(raw, (int, float)) and not isinstance(raw, bool):
                kwargs[name] = float(raw) if name.endswith("_s") else int(raw)
        return cls(**kwargs)  # type: ignore[arg-type]


@dataclass(frozen=True)
class StepTiming:
    """When one step ran (module docstring). Synchronous: one span, start_s to end_s. Async: its launch from
    start_s, then its settle from settle_start_s (after the next step's launch) to end_s."""

    start_s: float = 0.0
    end_s: float = 0.0
    launch_time_s: float = 0.0
    settle_start_s: float | None = None
    """None: a synchronous step."""

    @property
    def step_time_s(self) -> float:
        if self.settle_start_s is None:
            return self.end_s - self.start_s
        return self.launch_time_s + self.end_s - self.settle_start_s


def step_record(output: SchedulerOutput, stats: SchedulerStats | None = None, start_s: float = 0.0,
                end_s: float = 0.0, timing: StepTiming | None = None) -> StepRecord:
    """The record of one step that scheduled `output` and reported `stats` (None: before its update, as the
    simulation prices a step before applying it; no preemptions are counted then), timed by `timing` (None:
    one span from start_s to end_s)."""
    timing = timing or StepTiming(start_s, end_s)
    counts, drafts = output.num_scheduled_tokens, output.scheduled_spec_decode_tokens
    new, cached = output.scheduled_new_reqs, output.scheduled_cached_reqs
    # List comprehensions, not one loop with branches: with hundreds of decodes this is the log's whole cost.
    scheduled = [counts.get(request_id, 0) for request_id in cached.req_ids]
    if drafts:  # a decode verifying K drafts computes 1 + K tokens: the tokens besides its drafts tell a chunk
        chunks = [n for request_id, n in zip(cached.req_ids, scheduled) if n - len(drafts.get(request_id, ())) > 1]
    else:
        chunks = [n for n in scheduled if n > 1]
    prefill_tokens = sum(counts.get(request.request_id, 0) for request in new) + sum(chunks)
    prefill_reqs = len(new) + len(chunks)
    computed = sum(request.num_computed_tokens for request in new) + sum(cached.num_computed_tokens)
    context = computed + output.total_num_scheduled_tokens
    num_reqs = len(new) + cached.num_reqs
    return StepRecord(
        num_prefill_tokens=prefill_tokens,
        num_decode_tokens=output.total_num_scheduled_tokens - prefill_tokens,
        num_prefill_reqs=prefill_reqs, num_decode_reqs=num_reqs - prefill_reqs, num_context_tokens=context,
        num_draft_tokens=sum(len(d) for d in drafts.values()),
        num_preemptions=stats.num_preemptions if stats is not None else 0, step_time_s=timing.step_time_s,
        start_s=timing.start_s, launch_time_s=timing.launch_time_s, end_s=timing.end_s)


class StepLog:
    """The newest `capacity` step records (older ones are dropped: memory stays bounded on a long run)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"step log capacity must be >= 1 (got {capacity})")
        self._records: deque[StepRecord] = deque(maxlen=capacity)

    def record(self, output: SchedulerOutput, stats: SchedulerStats, start_s: float = 0.0, end_s: float = 0.0,
               timing: StepTiming | None = None) -> None:
        """Log one step; an empty step (nothing computed) is skipped: it costs no model time."""
        if output.is_empty:
            return
        self._records.append(step_record(output, stats, start_s, end_s, timing))

    def drain(self) -> list[StepRecord]:
        """Every record held, oldest first; the log is empty afterwards."""
        records = list(self._records)
        self._records.clear()
        return records

    def __len__(self) -> int:
        return len(self._records)
