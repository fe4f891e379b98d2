"""What both batching policies share: request bookkeeping, the running-request pass, preemption,
applying the model's output (append, stop, free), aborts, queue timeouts, stats and invariants.

Model: every accepted request is in exactly one place: the waiting queue (status WAITING, or PREEMPTED
after losing its blocks), the running list (RUNNING, in admission order, holding blocks), or gone
(FINISHED: blocks freed, id reported once in the next `SchedulerOutput.finished_req_ids` if the worker
held it). A policy only decides which waiting requests start running (`schedule`); everything else is
here. Finished requests' outputs carry their timings; queue-timeout outputs are produced during
`schedule` and handed out by the next `update_from_output`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from conveyor.config import CacheConfig, SchedulerConfig, SchedulingPolicy
from conveyor.core.errors import AdmissionError, QueueFullError
from conveyor.core.kv_cache_manager import KVCacheBlock, KVCacheManager
from conveyor.core.fast_outputs import cached_request_data, token_output
from conveyor.core.invariants import check_scheduler_invariants
from conveyor.core.lifecycle import KVCapacity, StopSpec, append_tokens, check_admission, make_stop_spec
from conveyor.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from conveyor.core.request_queue import make_request_queue
from conveyor.core.stats import SchedulerStats
from conveyor.core.step import StepBuilder
from conveyor.request import FinishReason, Request, RequestStatus

_RUNNING = RequestStatus.RUNNING


@dataclass
class StepCounters:
    """What happened since the last `update_from_output`, for its SchedulerStats."""

    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_queue_timeouts: int = 0


class SchedulerBase(ABC):
    """The scheduler interface the engine drives; subclasses implement `schedule()`."""

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

    # ---- the interface -------------------------------------------------------------------------

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

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Decide what the next model step computes."""

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> tuple[list[EngineCoreOutput], SchedulerStats]:
        """Append sampled tokens, check stops, free finished requests; one output per request with news."""
        now_s = self.clock()
        outputs, self.pending_outputs = self.pending_outputs, []
        requests, stop_specs, logprobs = self.requests, self.stop_specs, model_runner_output.logprobs
        num_unfinished = len(requests)
        num_generated = 0
        for request_id, token_ids in model_runner_output.sampled_token_ids.items():
            request = requests.get(request_id)
            if not token_ids or request is None or request.status is not _RUNNING:
                continue  # partial prefill chunk, or finished (aborted) since it was scheduled
            new_logprobs = logprobs.get(request_id, []) if logprobs else []
            spec = stop_specs[request_id]
            output_token_ids = request.output_token_ids
            timings = request.timings
            if (len(token_ids) == 1 and token_ids[0] not in spec.stop_token_ids and timings.first_token_s is not None
                    and len(output_token_ids) + 1 < spec.max_num_output_tokens):
                # The common case, kept to the bare minimum: one more token that cannot stop the request.
                output_token_ids.append(token_ids[0])
                timings.token_times_s.append(now_s)
                timings.last_token_s = now_s
                outputs.append(token_output(request_id, token_ids, new_logprobs))
                num_generated += 1
            else:
                num_generated += self._apply_tokens(request, token_ids, now_s, new_logprobs, outputs)
        if len(requests) != num_unfinished:  # some finished: they leave the running list
            self.running = [request for request in self.running if request.status is _RUNNING]
        return outputs, self._take_stats(scheduler_output, num_generated, now_s)

    def _apply_tokens(self, request: Request, token_ids: list[int], now_s: float,
                      new_logprobs: list[TokenLogprobs], outputs: list[EngineCoreOutput]) -> int:
        """The general case of update_from_output: append, check stops, finish; returns tokens kept."""
        new_token_ids, reason, stop_token = append_tokens(request, token_ids, now_s,
                                                          self.stop_specs[request.request_id])
        if reason is None:
            outputs.append(token_output(request.request_id, new_token_ids, new_logprobs))
        else:
            request.stop_reason = stop_token
            outputs.append(self._finish(request, reason, now_s, new_token_ids, new_logprobs))
        return len(new_token_ids)

    def finish_requests(self, request_ids: Iterable[str], reason: FinishReason) -> list[EngineCoreOutput]:
        """End requests from outside (abort, stop string); unknown or finished ids are ignored."""
        now = self.clock()
        outputs = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status is _RUNNING:
                del self.running[_index_of(self.running, request)]
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

    # ---- shared scheduling helpers -------------------------------------------------------------

    def _schedule_running(self, step: StepBuilder) -> None:
        """Give each running request, in admission order, what it needs within the budget."""
        unsent = self.unsent_req_ids
        fast_num_tokens = self.kv_cache_manager.fast_num_tokens
        add_cached = step.cached_reqs.append
        num_scheduled_tokens = step.num_scheduled_tokens
        budget = step.token_budget
        for request in list(self.running):  # a copy: preemption removes victims from self.running
            if budget <= 0:
                break
            if request.status is not _RUNNING:
                continue  # preempted earlier in this step
            request_id = request.request_id
            num_computed = request.num_computed_tokens
            num_prompt = len(request.prompt_token_ids)
            if (num_prompt + len(request.output_token_ids) - num_computed == 1
                    and num_prompt <= num_computed < fast_num_tokens[request_id]
                    and not (unsent and request_id in unsent)):
                # A decode whose slot is already held (no block to take, none to index): the common
                # case, kept to the bare minimum; it is exactly what schedule_one_running would do.
                add_cached(cached_request_data(request_id, [], num_computed))
                num_scheduled_tokens[request_id] = 1
                request.num_computed_tokens = num_computed + 1
                budget -= 1
                continue
            step.token_budget = budget
            if not self._schedule_one_running(request, step):
                break
            budget = step.token_budget
        step.token_budget = budget

    def _schedule_one_running(self, request: Request, step: StepBuilder) -> bool:
        """The general case: a prefill chunk, a decode needing a block, or a first send; False if the
        request had to preempt itself (then nothing after it is served this step)."""
        num_new_tokens = request.num_tokens - request.num_computed_tokens
        threshold = self.long_prefill_token_threshold
        if threshold is not None and num_new_tokens > threshold:
            num_new_tokens = threshold
        num_new_tokens = min(num_new_tokens, step.token_budget)
        if num_new_tokens <= 0:  # nothing to compute (its sampled token has not come back)
            return True
        new_block_ids = self.kv_cache_manager.append_slots(request, num_new_tokens)
        if new_block_ids is None:
            new_block_ids = self._preempt_until_fits(request, num_new_tokens, step)
            if new_block_ids is None:
                return False
        if request.request_id in self.unsent_req_ids:
            step.schedule_new(request, num_new_tokens, self.kv_cache_manager.get_block_ids(request.request_id))
        else:
            step.schedule_cached(request, num_new_tokens, new_block_ids)
        return True

    def _preempt_until_fits(self, request: Request, num_new_tokens: int, step: StepBuilder) -> list[int] | None:
        """Preempt victims until the request's slots fit; None if the request itself was the victim."""
        while True:
            victim = self._pick_victim()
            self._preempt(victim, step)
            if victim is request:
                return None
            new_block_ids = self.kv_cache_manager.append_slots(request, num_new_tokens)
            if new_block_ids is not None:
                return new_block_ids

    def _pick_victim(self) -> Request:
        """FCFS: the most recently admitted; priority: the largest (priority, arrival), latest admitted."""
        if self.scheduler_config.policy is SchedulingPolicy.FCFS:
            return self.running[-1]
        return max(reversed(self.running), key=lambda request: (request.priority, request.arrival_s))

    def _preempt(self, victim: Request, step: StepBuilder) -> None:
        """Recompute-preemption: free the blocks (their hashes stay cached), requeue at the front."""
        del self.running[_index_of(self.running, victim)]
        step.unschedule(victim)
        self.kv_cache_manager.free(victim)
        if victim.request_id in self.unsent_req_ids:
            self.unsent_req_ids.discard(victim.request_id)
        else:
            step.preempted_req_ids.add(victim.request_id)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        step.num_preemptions += 1
        self.counters.num_preemptions += 1
        self.waiting.prepend(victim)

    def _start_running(self, request: Request, num_new_tokens: int,
                       computed: tuple[list[KVCacheBlock], int], num_lookahead_tokens: int = 0) -> list[int] | None:
        """Move the head of the waiting queue to running with slots for its first tokens, if they fit."""
        computed_blocks, num_computed_tokens = computed
        new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new_tokens, computed_blocks,
                                                             num_lookahead_tokens)
        if new_block_ids is None:
            return None
        self.waiting.pop()
        self.kv_cache_manager.record_prefix_lookup(request.num_tokens, num_computed_tokens)
        if request.status is RequestStatus.WAITING:  # first admission (not a resumption)
            request.num_cached_tokens = num_computed_tokens
        request.status = _RUNNING
        request.num_computed_tokens = num_computed_tokens
        self.running.append(request)
        self.unsent_req_ids.add(request.request_id)
        return new_block_ids

    def _build_output(self, step: StepBuilder) -> SchedulerOutput:
        finished, self.finished_req_ids = self.finished_req_ids, set()
        for data in step.new_reqs:
            self.unsent_req_ids.discard(data.request_id)
        self.counters.num_prompt_tokens += step.num_prompt_tokens
        return step.build(finished)

    def _expire_queue_timeouts(self, now_s: float) -> None:
        """End waiting requests never scheduled within queue_timeout_s (emitted by the next update)."""
        timeout_s = self.scheduler_config.queue_timeout_s
        if timeout_s is None or not self.waiting:
            return
        expired = [request for request in self.waiting
                   if request.timings.first_scheduled_s is None and now_s - request.arrival_s > timeout_s]
        for request in expired:
            self.waiting.remove(request)
            self.pending_outputs.append(self._finish(request, FinishReason.QUEUE_TIMEOUT, now_s))
        self.counters.num_queue_timeouts += len(expired)

    # ---- applying outputs ----------------------------------------------------------------------

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

    def _take_stats(self, scheduler_output: SchedulerOutput, num_generated: int, now_s: float) -> SchedulerStats:
        prefix, counters = self.kv_cache_manager.take_prefix_cache_stats(), self.counters
        self.counters = StepCounters()
        return SchedulerStats(len(self.running), len(self.waiting), self.kv_cache_manager.usage,
                              counters.num_preemptions, prefix.num_queries, prefix.num_hits,
                              scheduler_output.total_num_scheduled_tokens, counters.num_prompt_tokens,
                              num_generated, counters.num_queue_timeouts, now_s)

    def check_invariants(self) -> None:
        """Block-pool invariants, and every unfinished request in exactly one consistent place."""
        check_scheduler_invariants(self)


def _index_of(requests: list[Request], request: Request) -> int:
    """Position by identity (Request's dataclass __eq__ would compare every field)."""
    for index, candidate in enumerate(requests):
        if candidate is request:
            return index
    raise ValueError(f"request {request.request_id} is not in the list")
