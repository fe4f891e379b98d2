"""The one admission decision, taken in the front end before a request is sent to the engine core.

Model (vLLM >= 0.32): a request is admitted or refused once, here, and the engine core only queues
what was admitted. Two kinds of refusal:

- It can never be served as asked (HTTP 400, naming the field): empty prompt, a token id outside the
  vocabulary, prompt (+ max_tokens) over max_model_len or over what the whole KV cache holds (the
  scheduler's own `core.lifecycle.check_admission`, so front end and scheduler cannot disagree), a
  request id already in flight.
- It could be served, but not now (HTTP 503 + Retry-After): `max_num_queued_reqs` caps the requests
  in flight, waiting + running, a request with n sequences counting n (`in_flight + n > cap`
  refuses); `max_num_queued_tokens` caps the prompt tokens of requests still in prefill
  (`queued >= cap` refuses, the new prompt not counted, as vLLM). A request is in flight from its
  admission until its final output reaches the front end or its client leaves; it is "in prefill"
  until its first output arrives (chunked progress and cache hits are not seen here: conservative).

With `--api-server-count N > 1` the counts are global: each front end writes its own two counters
into a shared array and admission, under one cross-process lock, compares the sum of all of them
with the cap and then raises its own, so the cap holds exactly across front ends.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.sharedctypes
import threading
from contextlib import AbstractContextManager
from dataclasses import dataclass

from conveyor.config import SchedulerConfig
from conveyor.core.errors import AdmissionError
from conveyor.core.lifecycle import KVPoolSize, check_admission
from conveyor.engine.types import EngineOverloadedError, OverloadReason, RequestRejectedError
from conveyor.request import Request
from conveyor.sampling_params import SamplingParams, StructuredOutput


@dataclass(frozen=True)
class RequestLimits:
    """What a single request must fit in (resolved by the engine core at start-up)."""

    scheduler: SchedulerConfig
    """The scheduler's configuration with the resolved max_model_len."""
    kv_capacity: KVPoolSize
    """The KV pool the scheduler was built over."""
    vocab_size: int
    """Token ids must be in [0, vocab_size)."""
    speculative: bool = False
    """Speculative decoding is on: structured outputs are refused (a draft's grammar state is not kept)."""
    tensor_parallel: bool = False
    """--tensor-parallel-size > 1: structured outputs are refused (only a single-rank runner masks)."""


def check_request(prompt_token_ids: list[int], params: SamplingParams, limits: RequestLimits) -> None:
    """Raise RequestRejectedError (naming `prompt` or `max_tokens`) if the request can never be served."""
    if not prompt_token_ids:
        raise RequestRejectedError("prompt", "prompt: must contain at least one token")
    probe = Request("admission-check", prompt_token_ids, params, arrival_s=0.0)
    try:
        check_admission(probe, limits.scheduler, limits.kv_capacity)  # lengths first: O(1)
    except AdmissionError as error:
        raise RequestRejectedError(error.field, str(error)) from None
    vocab_size = limits.vocab_size
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size:  # C loops, no per-id Python
        bad = next(t for t in prompt_token_ids if not 0 <= t < vocab_size)
        raise RequestRejectedError("prompt", f"prompt: token id {bad} is out of range [0, {vocab_size})")
    for token_id, _ in params.logit_bias:
        if token_id >= vocab_size:
            raise RequestRejectedError("logit_bias", f"logit_bias: token id {token_id} is out of range "
                                                     f"[0, {vocab_size})")
    _check_output_bounds(len(prompt_token_ids), params, limits)
    if params.structured_output is not None:
        _check_structured_output(params.structured_output, limits)


def _check_output_bounds(num_prompt_tokens: int, params: SamplingParams, limits: RequestLimits) -> None:
    """vLLM's 400s: a stop token id outside the vocabulary, and `min_tokens` past the room the context
    leaves (with max_tokens unset; a set one already bounds it), which would otherwise run to the limit."""
    vocab_size = limits.vocab_size
    bad = next((t for t in params.stop_token_ids if t >= vocab_size), None)
    if bad is not None:
        raise RequestRejectedError("stop_token_ids", f"stop_token_ids: token id {bad} is out of range "
                                                     f"[0, {vocab_size})")
    room = limits.scheduler.max_model_len - num_prompt_tokens
    if params.min_tokens > room:
        raise RequestRejectedError("min_tokens", f"min_tokens ({params.min_tokens}) exceeds the {room} tokens "
                                                 f"max_model_len ({limits.scheduler.max_model_len}) leaves after the "
                                                 f"prompt ({num_prompt_tokens} tokens)")


def _check_structured_output(constraint: StructuredOutput, limits: RequestLimits) -> None:
    """Whether this server can mask at all; the grammar itself is compiled off the event loop
    (`engine.grammar_check`), by the caller."""
    if limits.speculative:
        raise RequestRejectedError(constraint.field, f"{constraint.field}: structured outputs are not supported "
                                                     "with speculative decoding (--speculative-config) on this server")
    if limits.tensor_parallel:
        raise RequestRejectedError(constraint.field, f"{constraint.field}: structured outputs are not supported "
                                                     "with tensor parallelism (--tensor-parallel-size > 1) on this "
                                                     "server")


@dataclass(frozen=True)
class QueueLimits:
    """The 503 valves (None: no cap)."""

    max_num_queued_reqs: int | None
    """Cap on in-flight requests (waiting + running), n sequences counting n."""
    max_num_queued_tokens: int | None
    """Cap on the prompt tokens of requests still in prefill."""


@dataclass(frozen=True)
class SharedCounts:
    """Counters shared by N front-end processes: slot i holds front end i's (requests, prefill tokens)."""

    values: multiprocessing.sharedctypes.SynchronizedBase | object
    """A RawArray('q', 2 * num_clients) from the launcher's spawn context."""
    lock: AbstractContextManager[object]
    """A multiprocessing.Lock from the same context: admission's check-and-count is atomic across processes."""
    num_clients: int


def make_shared_counts(num_clients: int) -> SharedCounts:
    context = multiprocessing.get_context("spawn")
    return SharedCounts(context.RawArray("q", 2 * num_clients), context.Lock(), num_clients)


@dataclass
class _Entry:
    num_seqs: int
    num_prompt_tokens: int
    prefilling: bool = True


class AdmissionControl:
    """Counts this front end's in-flight requests and refuses what the caps do not allow."""

    def __init__(self, limits: QueueLimits, shared: SharedCounts | None = None, client_index: int = 0) -> None:
        self.limits = limits
        self._shared = shared
        self._slot = 2 * client_index
        self._entries: dict[str, _Entry] = {}
        self._num_seqs = 0
        self._num_queued_tokens = 0
        self._lock = shared.lock if shared is not None else threading.Lock()

    @property
    def num_in_flight(self) -> int:
        """This front end's in-flight sequences."""
        return self._num_seqs

    @property
    def num_queued_tokens(self) -> int:
        return self._num_queued_tokens

    def admit(self, request_id: str, num_prompt_tokens: int, num_seqs: int = 1) -> None:
        """Count the request in, or raise RequestRejectedError (duplicate id) / EngineOverloadedError."""
        if request_id in self._entries:
            raise RequestRejectedError("request_id", f"request_id: {request_id!r} is already in flight")
        with self._lock:
            total_seqs, total_tokens = self._totals()
            self._check_caps(total_seqs, total_tokens, num_seqs)
            self._entries[request_id] = _Entry(num_seqs, num_prompt_tokens)
            self._num_seqs += num_seqs
            self._num_queued_tokens += num_prompt_tokens
            self._publish()

    def prefill_done(self, request_id: str) -> None:
        """The request produced its first output: its prompt no longer counts as queued."""
        entry = self._entries.get(request_id)
        if entry is None or not entry.prefilling:
            return
        with self._lock:
            entry.prefilling = False
            self._num_queued_tokens -= entry.num_prompt_tokens
            self._publish()

    def release(self, request_id: str) -> None:
        """The request left (finished, aborted, failed); unknown ids are ignored (idempotent)."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return
        with self._lock:
            self._num_seqs -= entry.num_seqs
            if entry.prefilling:
                self._num_queued_tokens -= entry.num_prompt_tokens
            self._publish()

    def release_all(self) -> None:
        for request_id in list(self._entries):
            self.release(request_id)

    def _check_caps(self, total_seqs: int, total_tokens: int, num_seqs: int) -> None:
        max_reqs, max_tokens = self.limits.max_num_queued_reqs, self.limits.max_num_queued_tokens
        if max_reqs is not None and total_seqs + num_seqs > max_reqs:
            raise EngineOverloadedError(
                OverloadReason.MAX_NUM_QUEUED_REQS,
                f"{total_seqs} requests are already in flight (waiting + running; --max-num-queued-reqs="
                f"{max_reqs}); retry later or on another instance")
        if max_tokens is not None and total_tokens >= max_tokens:
            raise EngineOverloadedError(
                OverloadReason.MAX_NUM_QUEUED_TOKENS,
                f"{total_tokens} prompt tokens are already waiting for prefill (--max-num-queued-tokens="
                f"{max_tokens}); retry later or on another instance")

    def _totals(self) -> tuple[int, int]:
        """Sequences and prefill tokens in flight across all front ends (caller holds the lock)."""
        if self._shared is None:
            return self._num_seqs, self._num_queued_tokens
        values = self._shared.values
        return (sum(values[2 * i] for i in range(self._shared.num_clients)),  # type: ignore[index]
                sum(values[2 * i + 1] for i in range(self._shared.num_clients)))  # type: ignore[index]

    def _publish(self) -> None:
        if self._shared is not None:
            self._shared.values[self._slot] = self._num_seqs  # type: ignore[index]
            self._shared.values[self._slot + 1] = self._num_queued_tokens  # type: ignore[index]
