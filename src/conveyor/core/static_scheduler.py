"""Static (fixed-batch) scheduling, kept only as the baseline that continuous batching is measured against.

Model: when nothing is running, take waiting requests in queue order, up to `max_num_seqs`, while the
KV blocks for each one's whole life (prompt + its length limit) can be reserved up front; then run that
batch (prefill chunked only where the token budget forces it) until *every* member has finished, and
only then admit the next batch. Finished members free their blocks at once, but their seats stay empty:
the batch waits for its longest member, which is exactly the waste continuous batching removes. The
reservation means a batch never runs out of blocks, so it never preempts. Only how waiting requests
start differs from `Scheduler`: the admitted batch is then served by the same running pass.
"""

from __future__ import annotations

from conveyor.core.scheduler import Scheduler
from conveyor.core.step_builder import StepBuilder


class StaticScheduler(Scheduler):
    """The fixed-batch policy."""

    def _schedule_waiting(self, step: StepBuilder) -> None:
        """Admit a whole batch once the previous one has finished, and start serving it."""
        if self.running or not self.waiting:
            return
        max_num_seqs = self.scheduler_config.max_num_seqs
        while self.waiting and len(self.running) < max_num_seqs:
            request = self.waiting.peek()
            hit = self.kv_cache_manager.get_computed_blocks(request)
            # Slots for every token it may ever compute: all but the last one sampled.
            max_num_tokens = request.num_prompt_tokens + self.stop_specs[request.request_id].max_num_output_tokens
            if not self._start_running(request, hit, 0, num_lookahead_tokens=max_num_tokens - 1 - hit.num_tokens):
                break
        self._schedule_running(step, list(self.running))
