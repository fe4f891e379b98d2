"""The step logic both batching policies share: the running-request pass with preemption, starting
waiting requests, building the SchedulerOutput, and applying the model's output (append, stop, free).

A policy only decides which waiting requests start running (`schedule`). The two per-request loops
(`_schedule_running`, `update_from_output`) run for every running request at every step, so each keeps
its common case (a decode that gets its slot without preempting; one token that cannot stop) to a few
lines inline and hands everything else to a general helper.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from conveyor.config import SchedulingPolicy
from conveyor.core.kv_cache_manager import KVCacheBlock
from conveyor.core.lifecycle import append_tokens
from conveyor.core.outputs import NO_NEW_BLOCKS, EngineCoreOutputs, ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from conveyor.core.scheduler_state import StepCounters, SchedulerState, index_of
from conveyor.core.stats import SchedulerStats
from conveyor.core.step import StepBuilder
from conveyor.request import Request, RequestStatus

_RUNNING = RequestStatus.RUNNING


class SchedulerBase(SchedulerState, ABC):
    """The scheduler interface the engine drives; subclasses implement `schedule()`."""

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Decide what the next model step computes."""

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> tuple[EngineCoreOutputs, SchedulerStats]:
        """Append sampled tokens, check stops, free finished requests; report every request with news."""
        now_s = self.clock()
        outputs = EngineCoreOutputs(finished_outputs=self.pending_outputs)
        self.pending_outputs = []
        add_id, add_tokens = outputs.req_ids.append, outputs.new_token_ids.append
        requests, stop_specs, logprobs = self.requests, self.stop_specs, model_runner_output.logprobs
        num_unfinished = len(requests)
        num_generated = 0
        for request_id, token_ids in model_runner_output.sampled_token_ids.items():
            request = requests.get(request_id)
            if not token_ids or request is None or request.status is not _RUNNING:
                continue  # partial prefill chunk, or finished (aborted) since it was scheduled
            spec = stop_specs[request_id]
            output_token_ids = request.output_token_ids
            timings = request.timings
            if (len(token_ids) == 1 and token_ids[0] not in spec.stop_token_ids and timings.first_token_s is not None
                    and len(output_token_ids) + 1 < spec.max_num_output_tokens):
                # The common case, kept to the bare minimum: one more token that cannot stop the request.
                output_token_ids.append(token_ids[0])
                timings.token_times_s.append(now_s)
                timings.last_token_s = now_s
                add_id(request_id)
                add_tokens(token_ids)
                if logprobs and request_id in logprobs:
                    outputs.new_logprobs[request_id] = logprobs[request_id]
                num_generated += 1
            else:
                new_logprobs = logprobs.get(request_id, []) if logprobs else []
                num_generated += self._apply_tokens(request, token_ids, now_s, new_logprobs, outputs)
        if len(requests) != num_unfinished:  # some finished: they leave the running list
            self.running = [request for request in self.running if request.status is _RUNNING]
        return outputs, self._take_stats(scheduler_output, num_generated, now_s)

    def _apply_tokens(self, request: Request, token_ids: list[int], now_s: float,
                      new_logprobs: list[TokenLogprobs], outputs: EngineCoreOutputs) -> int:
        """The general case of update_from_output: append, check stops, finish; returns tokens kept."""
        request_id = request.request_id
        new_token_ids, reason, stop_token = append_tokens(request, token_ids, now_s, self.stop_specs[request_id])
        if reason is None:
            outputs.req_ids.append(request_id)
            outputs.new_token_ids.append(new_token_ids)
            if new_logprobs:
                outputs.new_logprobs[request_id] = new_logprobs
        else:
            request.stop_reason = stop_token
            outputs.finished_outputs.append(self._finish(request, reason, now_s, new_token_ids, new_logprobs))
        return len(new_token_ids)

    def _schedule_running(self, step: StepBuilder) -> None:
        """Give each running request, in admission order, what it needs within the budget."""
        unsent = self.unsent_req_ids
        fast_num_tokens, append_slots = self.kv_cache_manager.fast_num_tokens, self.kv_cache_manager.append_slots
        cached = step.cached_reqs  # appended to directly (three lists, no object per request)
        add_id, add_blocks, add_computed = cached.req_ids.append, cached.new_block_ids.append, \
            cached.num_computed_tokens.append
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
            if (num_prompt + len(request.output_token_ids) - num_computed == 1 and num_prompt <= num_computed
                    and not (unsent and request_id in unsent)):
                # A decode (the common case, kept to the bare minimum; exactly what _schedule_one_running
                # would do): its slot is held, or it crosses into a new block that the pool can give.
                new_block_ids = (NO_NEW_BLOCKS if num_computed < fast_num_tokens[request_id]
                                 else append_slots(request, 1))
                if new_block_ids is not None:
                    add_id(request_id)
                    add_blocks(new_block_ids)
                    add_computed(num_computed)
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
        """The general case: a prefill chunk, a first send, or a decode the pool has no block for; False
        if the request had to preempt itself (then nothing after it is served this step)."""
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
        del self.running[index_of(self.running, victim)]
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

    def _take_stats(self, scheduler_output: SchedulerOutput, num_generated: int, now_s: float) -> SchedulerStats:
        prefix, counters = self.kv_cache_manager.take_prefix_cache_stats(), self.counters
        self.counters = StepCounters()
        return SchedulerStats(len(self.running), len(self.waiting), self.kv_cache_manager.usage,
                              counters.num_preemptions, prefix.num_queries, prefix.num_hits,
                              scheduler_output.total_num_scheduled_tokens, counters.num_prompt_tokens,
                              num_generated, counters.num_queue_timeouts, now_s)
