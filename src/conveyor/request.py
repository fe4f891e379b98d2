"""A request's state as the scheduler sees it: token ids, progress, status and timestamps.

The model (vLLM V1): there is no prefill phase and no decode phase. A request holds
`all_token_ids = prompt + output` and `num_computed_tokens` (how many of them have KV in the cache).
Each step the scheduler gives it some tokens to close the gap; when the gap is closed the model samples
one new token, which is appended and reopens a gap of one. Chunked prefill, prefix-cache hits (which
start `num_computed_tokens` above zero), recompute after preemption (which resets it to zero) and
speculative decoding (draft tokens widen the gap; the rejected ones are taken back after the step) are
all the same loop.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from conveyor.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, at the front of the queue, to be recomputed
    FINISHED = "finished"

    @property
    def is_finished(self) -> bool:
        return self is RequestStatus.FINISHED


class FinishReason(enum.Enum):
    """Why a request ended; the values are vLLM's `finished_reason` labels plus our own."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # the client went away or the request was cancelled
    QUEUE_TIMEOUT = "queue_timeout"  # waited longer than queue_timeout_s without being scheduled
    ERROR = "error"  # the engine failed while running it


@dataclass
class RequestTimings:
    """Monotonic timestamps (seconds) of a request's life, as vLLM defines its intervals.

    queue time = first_scheduled - arrival; prefill time = first_token - first_scheduled;
    decode time = last_token - first_token; E2E = finished - arrival.
    """

    arrival_s: float
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    finished_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)


@dataclass
class Request:
    """One generation request. Mutable: the scheduler owns it from `add_request` to finish."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_s: float
    eos_token_id: int | None = None
    priority: int = 0  # lower value = served first under the priority policy (vLLM's convention)
    cache_salt: str | None = None  # separates prefix-cache namespaces (e.g. per tenant)

    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    # Async scheduling: output tokens being sampled by steps in flight, not yet in output_token_ids
    # (vLLM's name). The scheduler counts them in a request's gap so the next step computes them.
    num_output_placeholders: int = 0
    # Speculative decoding (vLLM's name): draft tokens for the request's next step, from the worker's
    # last ModelRunnerOutput; between schedule() and update_from_output() the ones that step verifies
    # (trimmed to what was scheduled, and counted in num_computed_tokens). Never in output_token_ids,
    # never hashed into the prefix cache.
    spec_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first scheduling
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks
    timings: RequestTimings = field(init=False)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        self.timings = RequestTimings(arrival_s=self.arrival_s)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def max_tokens(self) -> int | None:
        return self.sampling_params.max_tokens
