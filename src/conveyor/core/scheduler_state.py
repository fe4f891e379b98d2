"""The scheduler's bookkeeping, shared by both batching policies: where every request is, admission,
aborts, queue timeouts, finishing, and the invariants.

Model: every accepted request is in exactly one place: the waiting queue (status WAITING, or PREEMPTED
after losing its blocks), the running list (RUNNING, in admission order, holding blocks), or gone
(FINISHED: blocks freed, id reported once in the next `SchedulerOutput.finished_req_ids` if the worker
held it). Finished requests' outputs carry their timings; queue-timeout outputs are produced during
`schedule` and handed out by the next `update_from_output`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from conveyor.config import CacheConfig, SchedulerConfig
from conveyor.core.errors import AdmissionError, QueueFullError
from conveyor.core.invariants import check_scheduler_invariants
from conveyor.core.kv_cache_manager import KVCacheManager
from conveyor.core.lifecycle import KVCapacity, StopSpec, check_admission, make_stop_spec
from conveyor.core.outputs import EngineCoreOutput, TokenLogprobs
from conveyor.core.request_queue import make_request_queue
from conveyor.request import FinishReason, Request, RequestStatus

_RUNNING = RequestStatus.RUNNING


@dataclass
class StepCounters:
    """What happened since the last `update_from_output`, for its SchedulerStats."""

    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_queue_timeouts: int = 0


class SchedulerState:
    """Requests, queues, KV blocks and their bookkeeping; `SchedulerBase` adds the step logic."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.clock = clock
        self.block_size = cache_config.block_size
        self.enable_prefix_caching = cache_config.enable_prefix_caching
        self.kv_cache_manager = KVCacheManager(num_blocks, cache_config.block_size,
                                               cache_config.enable_prefix_caching)
        self.capacity = KVCapacity(num_blocks, cache_config.block_size)
        self.waiting = make_request_queue(scheduler_config.policy)
        self.running: list[Request] = []  # admission order
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.stop_specs: dict[str, StopSpec] = {}  # request id -> its stop conditions
        self.unsent_req_ids: set[str] = set()  # running, but the worker does not hold their state yet
        self.finished_req_ids: set[str] = set()  # for the next SchedulerOutput
        self.pending_outputs: list[EngineCoreOutput] = []  # queue timeouts, for update_from_output
        self.counters = StepCounters()  # since the last update_from_output
        chunked = scheduler_config.enable_chunked_prefill
        # The threshold is a chunked-prefill knob: with chunking off a prompt is never split.
        self.long_prefill_token_threshold = scheduler_config.long_prefill_token_threshold if chunked else None

    def add_request(self, request: Request) -> None:
        """Accept a request into the waiting queue, or raise AdmissionError / QueueFullError."""
        if request.request_id in self.requests:
            raise AdmissionError("request_id", f"{request.request_id!r} is already in use")
        max_num_tokens = check_admission(request, self.scheduler_config, self.capacity)
        max_queued = self.scheduler_config.max_num_queued_reqs
        if max_queued is not None and len(self.waiting) >= max_queued:
            raise QueueFullError(f"{len(self.waiting)} requests are already waiting "
                                 f"(max_num_queued_reqs={max_queued}); retry later")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.stop_specs[request.request_id] = make_stop_spec(request, max_num_tokens)
        self.waiting.add(request)

    def finish_requests(self, request_ids: Iterable[str], reason: FinishReason) -> list[EngineCoreOutput]:
        """End requests from outside (abort, stop string); unknown or finished ids are ignored."""
        now = self.clock()
        outputs = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status is _RUNNING:
                del self.running[index_of(self.running, request)]
            else:
                self.waiting.remove(request)
            outputs.append(self._finish(request, reason, now))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_cache_manager.usage

    def reset_prefix_cache(self) -> bool:
        """Drop all cached prefixes; only possible while no request holds blocks."""
        return self.kv_cache_manager.block_pool.reset_prefix_cache()

    def _expire_queue_timeouts(self, now_s: float) -> None:
        """End waiting requests never scheduled within queue_timeout_s (emitted by the next update)."""
        timeout_s = self.scheduler_config.queue_timeout_s
        if timeout_s is None or not self.waiting:
            return  # (an O(waiting) scan per step, only when a timeout is configured)
        expired = [request for request in self.waiting.unordered()
                   if request.timings.first_scheduled_s is None and now_s - request.arrival_s > timeout_s]
        self.waiting.remove_all(expired)
        for request in expired:
            self.pending_outputs.append(self._finish(request, FinishReason.QUEUE_TIMEOUT, now_s))
        self.counters.num_queue_timeouts += len(expired)

    def _finish(self, request: Request, reason: FinishReason, now_s: float, new_token_ids: list[int] | None = None,
                new_logprobs: list[TokenLogprobs] | None = None) -> EngineCoreOutput:
        """Mark finished and free everything; the caller removes it from waiting/running."""
        request_id = request.request_id
        if request.status is _RUNNING and request_id not in self.unsent_req_ids:
            self.finished_req_ids.add(request_id)
        self.unsent_req_ids.discard(request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.timings.finished_s = now_s
        self.kv_cache_manager.free(request)
        del self.requests[request_id]
        del self.stop_specs[request_id]
        return EngineCoreOutput(request_id, new_token_ids or [], new_logprobs or [], reason, request.stop_reason,
                                request.timings, request.num_prompt_tokens, request.num_cached_tokens,
                                request.num_preemptions)

    def check_invariants(self) -> None:
        """Block-pool invariants, and every unfinished request in exactly one consistent place."""
        check_scheduler_invariants(self)


def index_of(requests: list[Request], request: Request) -> int:
    """Position by identity (Request's dataclass __eq__ would compare every field)."""
    for index, candidate in enumerate(requests):
        if candidate is request:
            return index
    raise ValueError(f"request {request.request_id} is not in the list")
