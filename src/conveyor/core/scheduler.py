"""The scheduler (vLLM V1's semantics): what the next model step computes, and what its sampled tokens
do. Continuous batching; `StaticScheduler` and `AsyncScheduler` override one hook each.

Model: there is no prefill phase and no decode phase. A running request has a gap between the tokens
it knows (prompt, outputs, and `num_output_placeholders` still being sampled) and those with KV in the
cache (`num_computed_tokens`); a step closes gaps within a token budget. `schedule()`: the running
pass gives each running request, in admission order, its gap capped by `long_prefill_token_threshold`
and the budget left, and when its blocks cannot be allocated preempts the most recently admitted
(FCFS) or lowest-priority request until they fit or it is itself the victim; then, only if nothing was
preempted (admitting under pool pressure would thrash), the waiting pass starts queue heads while
fewer than `max_num_seqs` run and budget remains, each reusing its longest cached prefix, its prompt
chunked (chunked prefill on) or fitting whole (off; else it and everything behind it waits); the
`SchedulerOutput` holds ints only. `update_from_output()` appends sampled tokens with the stop checks,
finishes (frees) stopped requests and reports each request with news. Speculative decoding
(spec_decode.py) rides on the same loop: a request's drafts widen its gap, and the update takes the
rejected ones back. Hooks: `_schedule_waiting` (how waiting requests start) and `_count_in_flight` (how
tokens of a step still in flight are counted).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from conveyor.config import CacheConfig, SchedulerConfig, SchedulingPolicy, SpeculativeConfig
from conveyor.core.errors import AdmissionError, QueueFullError
from conveyor.core.invariants import check_scheduler_invariants
from conveyor.core.kv_cache_manager import KVCacheManager, PrefixHit
from conveyor.core.lifecycle import KVPoolSize, StopSpec, check_admission, check_stop, make_stop_spec
from conveyor.core.outputs import (
    NO_NEW_BLOCKS,
    EngineCoreOutput,
    EngineCoreOutputs,
    ModelRunnerOutput,
    SchedulerOutput,
    TokenLogprobs,
)
from conveyor.core.request_queue import make_request_queue, remove_by_identity
from conveyor.core.spec_decode import apply_verification, num_drafts_allowed, num_lookahead_slots, store_drafts
from conveyor.core.stats import SchedulerStats, SpecDecodingStats, StepCounters
from conveyor.core.step_builder import StepBuilder
from conveyor.request import FinishReason, Request, RequestStatus

_RUNNING = RequestStatus.RUNNING


class Scheduler:
    """Continuous batching: the batch is refilled at every step. The engine drives `add_request`,
    `schedule`, `update_from_output` and `finish_requests`."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int,
                 clock: Callable[[], float] = time.monotonic,
                 speculative_config: SpeculativeConfig | None = None) -> None:
        self.scheduler_config = scheduler_config
        self.clock = clock
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(num_blocks, cache_config.block_size,
                                               cache_config.enable_prefix_caching)
        self.pool_size = KVPoolSize(num_blocks=num_blocks, block_size=cache_config.block_size)
        self.waiting = make_request_queue(scheduler_config.policy)
        self.running: list[Request] = []  # admission order
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.stop_specs: dict[str, StopSpec] = {}  # request id -> its stop conditions
        self.unsent_req_ids: set[str] = set()  # running, but the worker does not hold their state yet
        self.finished_req_ids: set[str] = set()  # for the next SchedulerOutput
        self.pending_outputs: list[EngineCoreOutput] = []  # queue timeouts, for the next update
        self.counters = StepCounters()  # since the last update_from_output
        self.preempted_between_steps: set[str] = set()  # by reset_prefix_cache, for the next step
        # The threshold is a chunked-prefill knob: with chunking off a prompt is never split.
        chunked = scheduler_config.enable_chunked_prefill
        self.long_prefill_token_threshold = scheduler_config.long_prefill_token_threshold if chunked else None
        # Speculative decoding (spec_decode.py): K, and the slots a draft model writes past a step's tokens.
        self.num_spec_tokens = speculative_config.num_speculative_tokens if speculative_config else 0
        self.num_lookahead_tokens = speculative_config.num_lookahead_tokens if speculative_config else 0

    def add_request(self, request: Request) -> None:
        """Accept a request into the waiting queue, or raise AdmissionError / QueueFullError."""
        if request.request_id in self.requests:
            raise AdmissionError("request_id", f"{request.request_id!r} is already in use")
        max_num_tokens = check_admission(request, self.scheduler_config, self.pool_size)
        max_queued = self.scheduler_config.max_num_queued_reqs
        if max_queued is not None and len(self.waiting) >= max_queued:
            raise QueueFullError(f"{len(self.waiting)} requests are already waiting "
                                 f"(max_num_queued_reqs={max_queued}); retry later")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.stop_specs[request.request_id] = make_stop_spec(request, max_num_tokens)
        self.waiting.add(request)

    def schedule(self) -> SchedulerOutput:
        """Decide what the next model step computes: running pass, waiting pass, output."""
        now_s = self.clock()
        self._expire_queue_timeouts(now_s)
        step = StepBuilder(self.scheduler_config.max_num_batched_tokens, now_s)
        self._schedule_running(step, list(self.running))  # a copy: preemption removes victims
        if self.preempted_between_steps:  # (reset_prefix_cache) no admission: their tokens in flight
            step.preempted_req_ids |= self.preempted_between_steps  # must find them preempted
            self.preempted_between_steps = set()
        elif step.num_preemptions == 0:
            self._schedule_waiting(step)
        finished, self.finished_req_ids = self.finished_req_ids, set()
        for data in step.new_reqs:
            self.unsent_req_ids.discard(data.request_id)
        self.counters.num_prompt_tokens += step.num_prompt_tokens
        scheduler_output = step.build(finished)
        self._count_in_flight(scheduler_output)
        return scheduler_output

    def _schedule_running(self, step: StepBuilder, requests: list[Request]) -> None:
        """Give each request, in order (running ones in admission order; then each one the waiting pass
        starts), what closes its gap within the budget. Runs for every running request at every step:
        the common case (its blocks have room; a decode needs a block every block_size steps) calls nothing."""
        num_slots, speculating, lookahead = (self.kv_cache_manager.num_slots, self.num_spec_tokens,
                                             self.num_lookahead_tokens)
        unsent, cached, num_scheduled_tokens = self.unsent_req_ids, step.cached_reqs, step.num_scheduled_tokens
        add_id, add_blocks, add_computed = (cached.req_ids.append, cached.new_block_ids.append,
                                            cached.num_computed_tokens.append)  # three parallel lists
        for request in requests:
            budget = step.token_budget
            if budget <= 0:
                break
            if request.status is not _RUNNING:
                continue  # preempted earlier in this step
            request_id, num_computed = request.request_id, request.num_computed_tokens
            num_prompt = len(request.prompt_token_ids)  # the gap: known + in-flight tokens - computed ones
            num_new_tokens = num_prompt + len(request.output_token_ids) + request.num_output_placeholders - num_computed
            if num_new_tokens != 1 or speculating and request.spec_token_ids:  # (one token always fits)
                num_new_tokens = self._cap_new_tokens(request, num_new_tokens, step)
                if num_new_tokens <= 0:
                    continue  # nothing to compute until its sampled token is back
            num_tokens_after = num_computed + num_new_tokens
            num_lookahead = lookahead and self._num_lookahead(request, num_tokens_after)
            if num_tokens_after + num_lookahead <= num_slots[request_id]:
                new_block_ids: Sequence[int] = NO_NEW_BLOCKS
            else:
                appended = self._append_slots_or_preempt(request, num_new_tokens, num_lookahead, step)
                if appended is None:
                    break  # it preempted itself: nothing after it is served this step
                new_block_ids, budget = appended, step.token_budget  # victims gave their tokens back
            if unsent and request_id in unsent:
                step.add_new(request, self.kv_cache_manager.get_block_ids(request_id))
            else:  # the worker holds it: only the blocks appended this step travel
                add_id(request_id)
                add_blocks(new_block_ids)
                add_computed(num_computed)
            num_scheduled_tokens[request_id] = num_new_tokens
            step.token_budget = budget - num_new_tokens
            if num_computed < num_prompt:
                step.count_prompt_tokens(request_id, min(num_tokens_after, num_prompt) - num_computed)
            request.num_computed_tokens = num_tokens_after  # advances when scheduled

    def _cap_new_tokens(self, request: Request, num_new_tokens: int, step: StepBuilder) -> int:
        """A gap other than a one-token decode, widened by the request's drafts (trimmed to its length
        limit), capped by the prefill threshold and the budget; the drafts are then trimmed to what
        fits (a budget of one verifies none) and recorded in the step (which drops them again if the
        request turns out to be a preemption victim)."""
        budget = step.token_budget
        drafts, num_gap = request.spec_token_ids, num_new_tokens
        if drafts and num_gap > 0:
            num_allowed = num_drafts_allowed(request, self.stop_specs[request.request_id].max_num_output_tokens)
            num_new_tokens += max(0, min(len(drafts), num_allowed))
        threshold = self.long_prefill_token_threshold
        if threshold is not None and num_new_tokens > threshold:
            num_new_tokens = threshold
        if num_new_tokens > budget:
            num_new_tokens = budget
        if drafts:
            request.spec_token_ids = drafts = drafts[:max(0, num_new_tokens - num_gap)]
            if drafts:
                step.spec_decode_tokens[request.request_id] = drafts
        return num_new_tokens

    def _num_lookahead(self, request: Request, num_tokens_after: int) -> int:
        """Draft model: slots past the step's tokens for its proposals' KV (none past the length limit)."""
        max_num_slots = len(request.prompt_token_ids) + self.stop_specs[request.request_id].max_num_output_tokens - 1
        return num_lookahead_slots(num_tokens_after, max_num_slots, self.num_lookahead_tokens)

    def _append_slots_or_preempt(self, request: Request, num_new_tokens: int, num_lookahead: int,
                                 step: StepBuilder) -> list[int] | None:
        """The request's new blocks, preempting victims until they fit; None if it was the victim."""
        while True:
            new_block_ids = self.kv_cache_manager.append_slots(request, num_new_tokens, num_lookahead)
            if new_block_ids is not None:
                return new_block_ids
            victim = self._pick_victim()
            self._preempt(victim, step)
            if victim is request:
                return None

    def _pick_victim(self) -> Request:
        """FCFS: the most recently admitted; priority: the largest (priority, arrival), latest admitted."""
        if self.scheduler_config.policy is SchedulingPolicy.FCFS:
            return self.running[-1]
        return max(reversed(self.running), key=lambda request: (request.priority, request.arrival_s))

    def _preempt(self, victim: Request, step: StepBuilder) -> None:
        """Recompute-preemption: free the blocks (their hashes stay cached), requeue at the front. Its
        outputs are kept; a token in flight is dropped (ignored when it comes back) and recomputed."""
        remove_by_identity(self.running, victim)
        step.unschedule(victim)
        victim.num_output_placeholders = 0
        victim.spec_token_ids = []  # drafts of a context that is now recomputed: it drafts again
        self.kv_cache_manager.free(victim)
        if victim.request_id not in self.unsent_req_ids:  # the worker holds its state: it drops it
            step.preempted_req_ids.add(victim.request_id)
        self.unsent_req_ids.discard(victim.request_id)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        step.num_preemptions += 1
        self.counters.num_preemptions += 1
        self.waiting.prepend(victim)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's: forget the prefix cache if no request holds KV blocks (else False); `reset_running_requests`
        first preempts the running ones (recomputed later). Between steps only."""
        if reset_running_requests:
            between = StepBuilder(0, self.clock())
            for request in reversed(list(self.running)):  # latest first: requeued at the front in order
                self._preempt(request, between)
            self.preempted_between_steps |= between.preempted_req_ids
        return self.kv_cache_manager.reset_prefix_cache()

    def _schedule_waiting(self, step: StepBuilder) -> None:
        """Hook, how waiting requests start: queue heads, each with its first chunk, while they fit."""
        max_num_seqs = self.scheduler_config.max_num_seqs
        while self.waiting and step.token_budget > 0 and len(self.running) < max_num_seqs:
            request = self.waiting.peek()
            hit = self.kv_cache_manager.get_computed_blocks(request)
            num_new_tokens = request.num_tokens - hit.num_tokens
            if self.scheduler_config.enable_chunked_prefill:
                if self.long_prefill_token_threshold is not None:
                    num_new_tokens = min(num_new_tokens, self.long_prefill_token_threshold)
                num_new_tokens = min(num_new_tokens, step.token_budget)
            elif num_new_tokens > step.token_budget:
                return  # without chunking it must fit whole; it, and everything behind it, waits
            num_lookahead = self.num_lookahead_tokens and self._num_lookahead(request, hit.num_tokens + num_new_tokens)
            if not self._start_running(request, hit, num_new_tokens, num_lookahead):
                return
            self._schedule_running(step, [request])  # its slots are allocated: it gets num_new_tokens

    def _start_running(self, request: Request, hit: PrefixHit, num_new_tokens: int,
                       num_lookahead_tokens: int = 0) -> bool:
        """Move the queue head to running with slots for its first tokens (plus a lookahead
        reservation) if they fit; else change nothing."""
        if self.kv_cache_manager.allocate_slots(request, num_new_tokens, hit.blocks, num_lookahead_tokens) is None:
            return False
        self.waiting.pop()
        self.kv_cache_manager.record_prefix_lookup(request.num_tokens, hit.num_tokens)
        if request.status is RequestStatus.WAITING:  # first admission (not a resumption)
            request.num_cached_tokens = hit.num_tokens
        request.status = _RUNNING
        request.num_computed_tokens = hit.num_tokens
        self.running.append(request)
        self.unsent_req_ids.add(request.request_id)
        return True

    def _count_in_flight(self, scheduler_output: SchedulerOutput) -> None:
        """Hook, how tokens sampled by a step in flight are counted: not at all. The engine applies
        every step's output before it schedules the next, so no token is in flight then."""

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> tuple[EngineCoreOutputs, SchedulerStats]:
        """Append each request's sampled tokens with the stop checks, finish (free) the stopped ones, and
        report every request with news. Runs for every running request at every step: a token that
        cannot stop its request costs one set lookup, one comparison and no call."""
        now_s = self.clock()
        outputs = EngineCoreOutputs(finished_outputs=self.pending_outputs)
        self.pending_outputs = []
        requests, stop_specs, logprobs = self.requests, self.stop_specs, model_runner_output.logprobs
        add_req_id, add_token_ids = outputs.req_ids.append, outputs.new_token_ids.append
        num_unfinished = len(requests)
        spec_decoding = self._apply_verification(scheduler_output, model_runner_output)
        for request_id, token_ids in model_runner_output.sampled_token_ids.items():
            request = requests.get(request_id)
            if not token_ids or request is None or request.status is not _RUNNING:
                continue  # a partial prefill chunk, or finished / preempted since it was scheduled
            if request.num_output_placeholders:
                request.num_output_placeholders -= len(token_ids)  # they were in flight: now known
            spec, output_token_ids, timings = stop_specs[request_id], request.output_token_ids, request.timings
            if timings.first_token_s is None:
                timings.first_token_s = now_s
            timings.last_token_s = now_s
            num_before, reason = len(output_token_ids), None
            for token_id in token_ids:
                output_token_ids.append(token_id)
                timings.token_times_s.append(now_s)
                if token_id in spec.stop_token_ids or len(output_token_ids) >= spec.max_num_output_tokens:
                    reason = check_stop(request, token_id, spec)
                    if reason is not None:
                        break
            if reason is None:  # it goes on: one index of the parallel lists
                add_req_id(request_id)
                add_token_ids(token_ids)
                if logprobs and request_id in logprobs:
                    outputs.new_logprobs[request_id] = logprobs[request_id]
            else:  # the tokens after the stop are dropped
                outputs.finished_outputs.append(self._finish(
                    request, reason, now_s, token_ids[:len(output_token_ids) - num_before], logprobs.get(request_id)))
        if len(requests) != num_unfinished:  # some finished: they leave the running list
            self.running = [request for request in self.running if request.status is _RUNNING]
        if model_runner_output.spec_token_ids:
            store_drafts(requests, model_runner_output.spec_token_ids)
        num_generated = (sum(map(len, outputs.new_token_ids))  # every kept token is reported once
                         + sum(len(output.new_token_ids) for output in outputs.finished_outputs))
        return outputs, self._take_stats(scheduler_output, num_generated, now_s, spec_decoding)

    def _apply_verification(self, scheduler_output: SchedulerOutput,
                            model_runner_output: ModelRunnerOutput) -> SpecDecodingStats | None:
        """Speculative decoding: the rejected drafts are taken back before the kept tokens are appended
        (spec_decode.py); None when the step verified no drafts."""
        if not scheduler_output.scheduled_spec_decode_tokens:
            return None
        return apply_verification(self.requests, scheduler_output, model_runner_output, self.num_spec_tokens)

    def finish_requests(self, request_ids: Iterable[str], reason: FinishReason) -> list[EngineCoreOutput]:
        """End requests from outside (abort, stop string); unknown or finished ids are ignored."""
        now_s = self.clock()
        outputs = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status is _RUNNING:
                remove_by_identity(self.running, request)
            else:
                self.waiting.remove(request)
            outputs.append(self._finish(request, reason, now_s))
        return outputs

    def _finish(self, request: Request, reason: FinishReason, now_s: float, new_token_ids: list[int] | None = None,
                new_logprobs: list[TokenLogprobs] | None = None) -> EngineCoreOutput:
        """Mark finished and free everything; the caller removes it from waiting/running."""
        request_id = request.request_id
        if request.status is _RUNNING and request_id not in self.unsent_req_ids:
            self.finished_req_ids.add(request_id)
        self.unsent_req_ids.discard(request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.num_output_placeholders = 0  # a token still in flight is ignored when it comes back
        request.timings.finished_s = now_s
        self.kv_cache_manager.free(request)
        del self.requests[request_id], self.stop_specs[request_id]
        return EngineCoreOutput(
            request_id=request_id, new_token_ids=new_token_ids or [], new_logprobs=new_logprobs or [],
            finish_reason=reason, stop_reason=request.stop_reason, timings=request.timings,
            num_prompt_tokens=request.num_prompt_tokens, num_cached_tokens=request.num_cached_tokens,
            num_preemptions=request.num_preemptions)

    def _expire_queue_timeouts(self, now_s: float) -> None:
        """End waiting requests never scheduled within queue_timeout_s (reported by the next update)."""
        timeout_s = self.scheduler_config.queue_timeout_s
        if timeout_s is None or not self.waiting:
            return  # (an O(waiting) scan per step, only when a timeout is configured)
        expired = [request for request in self.waiting.unordered()
                   if request.timings.first_scheduled_s is None and now_s - request.arrival_s > timeout_s]
        self.waiting.remove_all(expired)
        for request in expired:
            self.pending_outputs.append(self._finish(request, FinishReason.QUEUE_TIMEOUT, now_s))
        self.counters.num_queue_timeouts += len(expired)

    def _take_stats(self, scheduler_output: SchedulerOutput, num_generated: int, now_s: float,
                    spec_decoding: SpecDecodingStats | None) -> SchedulerStats:
        prefix, counters = self.kv_cache_manager.take_prefix_cache_stats(), self.counters
        self.counters = StepCounters()
        return SchedulerStats(
            num_running_reqs=len(self.running), num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage, num_preemptions=counters.num_preemptions,
            prefix_cache_queries=prefix.num_queries, prefix_cache_hits=prefix.num_hits,
            num_scheduled_tokens=scheduler_output.total_num_scheduled_tokens,
            num_prompt_tokens=counters.num_prompt_tokens, num_generation_tokens=num_generated,
            num_queue_timeouts=counters.num_queue_timeouts, step_time_s=now_s, spec_decoding=spec_decoding)

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

    def check_invariants(self) -> None:
        """Block-pool invariants, and every unfinished request in exactly one consistent place."""
        check_scheduler_invariants(self)
