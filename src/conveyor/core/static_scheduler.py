"""Static (fixed-batch) scheduling, kept only as the baseline that continuous batching is measured against.

Model: when nothing is running, take waiting requests in queue order, up to `max_num_seqs`, while the
KV blocks for each one's whole life (prompt + its length limit) can be reserved up front; then run that
batch (prefill chunked only where the token budget forces it) until *every* member has finished, and
only then admit the next batch. Finished members free their blocks at once, but their seats stay empty:
the batch waits for its longest member, which is exactly the waste continuous batching removes. The
reservation means a batch never runs out of blocks, so it never preempts.
"""

from __future__ import annotations

from conveyor.core.outputs import SchedulerOutput
from conveyor.core.scheduler_base import SchedulerBase
from conveyor.core.step import StepBuilder


class StaticScheduler(SchedulerBase):
    """The fixed-batch policy."""

    def schedule(self) -> SchedulerOutput:
        now_s = self.clock()
        self._expire_queue_timeouts(now_s)
        step = StepBuilder(self.scheduler_config.max_num_batched_tokens, now_s)
        if not self.running:
            self._admit_batch()
        self._schedule_running(step)
        return self._build_output(step)

    def _admit_batch(self) -> None:
        max_num_seqs = self.scheduler_config.max_num_seqs
        while self.waiting and len(self.running) < max_num_seqs:
            request = self.waiting.peek()
            computed = self.kv_cache_manager.get_computed_blocks(request)
            # Slots for every token it may ever compute: all but the last one sampled.
            max_num_tokens = request.num_prompt_tokens + self.stop_specs[request.request_id].max_num_output_tokens
            num_reserved_tokens = max_num_tokens - 1 - computed[1]
            if self._start_running(request, 0, computed, num_reserved_tokens) is None:
                break
