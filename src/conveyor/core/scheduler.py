"""Continuous batching (vLLM V1 semantics): the batch is refilled at every step.

Model: a step has a token budget (`max_num_batched_tokens`). Running requests go first, in admission
order, each getting what closes its gap between known and computed tokens (one token for a decode, a
chunk for a prefill), capped by `long_prefill_token_threshold` and the remaining budget; if its blocks
cannot be allocated, the most recently admitted (FCFS) or lowest-priority running request is preempted
and recomputed later, until it fits or it is itself the victim. Then, only if nothing was preempted
(the pool is under pressure: admitting more would thrash), waiting requests start while fewer than
`max_num_seqs` run and budget remains. A waiting request first reuses its longest cached prefix; its
remaining prompt gets a chunk (chunked prefill on) or must fit whole (off; otherwise it and, in queue
order, everything behind it waits). A request whose blocks cannot be allocated also blocks the queue.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from conveyor.config import Batching, CacheConfig, SchedulerConfig
from conveyor.core.outputs import SchedulerOutput
from conveyor.core.scheduler_base import SchedulerBase
from conveyor.core.static_scheduler import StaticScheduler
from conveyor.core.step import StepBuilder
from conveyor.request import Request


class Scheduler(SchedulerBase):
    """The continuous-batching policy."""

    def schedule(self) -> SchedulerOutput:
        now_s = self.clock()
        self._expire_queue_timeouts(now_s)
        step = StepBuilder(self.scheduler_config.max_num_batched_tokens, now_s)
        self._schedule_running(step)
        if step.num_preemptions == 0:
            self._schedule_waiting(step)
        return self._build_output(step)

    def _schedule_waiting(self, step: StepBuilder) -> None:
        max_num_seqs = self.scheduler_config.max_num_seqs
        while self.waiting and step.token_budget > 0 and len(self.running) < max_num_seqs:
            if not self._admit(self.waiting.peek(), step):
                break

    def _admit(self, request: Request, step: StepBuilder) -> bool:
        """Start the queue head with its first chunk; False (nothing changed) if it must wait."""
        computed = self.kv_cache_manager.get_computed_blocks(request)
        num_new_tokens = request.num_tokens - computed[1]
        if self.scheduler_config.enable_chunked_prefill:
            threshold = self.long_prefill_token_threshold
            if threshold is not None:
                num_new_tokens = min(num_new_tokens, threshold)
            num_new_tokens = min(num_new_tokens, step.token_budget)
        elif num_new_tokens > step.token_budget:
            return False
        if self._start_running(request, num_new_tokens, computed) is None:
            return False
        step.schedule_new(request, num_new_tokens, self.kv_cache_manager.get_block_ids(request.request_id))
        return True


def make_scheduler(scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int,
                   clock: Callable[[], float] = time.monotonic) -> SchedulerBase:
    """The policy named by `scheduler_config.batching`."""
    if scheduler_config.batching is Batching.CONTINUOUS:
        if scheduler_config.async_scheduling:
            from conveyor.core.async_scheduler import AsyncScheduler  # it subclasses Scheduler

            return AsyncScheduler(scheduler_config, cache_config, num_blocks, clock)
        return Scheduler(scheduler_config, cache_config, num_blocks, clock)
    if scheduler_config.batching is Batching.STATIC:
        return StaticScheduler(scheduler_config, cache_config, num_blocks, clock)
    raise ValueError(f"unknown batching {scheduler_config.batching!r}")
