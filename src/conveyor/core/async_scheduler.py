"""Continuous batching with async scheduling: step N+1 is scheduled before step N's tokens are known.

Model: the engine launches step N+1, then applies step N's output (engine_core.AsyncEngineCore), so
when `schedule` runs, the tokens sampled by the step in flight are unknown. Each is counted on its
request (`num_output_placeholders`, vLLM's name) when its step is scheduled: the request's gap then
includes it, so the next step computes that position (the worker takes the input id from the previous
step's sampled tensor on the device) and everything else -- budget, block slots, chunking -- is the
synchronous scheduler unchanged. When the token comes back, `update_from_output` appends it with the
usual stop checks and the count drops by one. Invariants: a position whose token is in flight is never
hashed into the prefix cache (only known tokens are hashed); a request whose in-flight token may be its
last by length is not counted, so it is not scheduled again before that token is back (its gap is
zero); a request preempted or finished while in flight drops its count, and its in-flight token is
ignored. A stop token sampled in flight costs one wasted step for that request, as in vLLM.
"""

from __future__ import annotations

from conveyor.core.outputs import SchedulerOutput
from conveyor.core.scheduler import Scheduler


class AsyncScheduler(Scheduler):
    """`Scheduler` that counts the tokens of the one step in flight."""

    def _count_in_flight(self, scheduler_output: SchedulerOutput) -> None:
        """Each scheduled request whose step samples (its gap closes) has one more token in flight."""
        requests, stop_specs = self.requests, self.stop_specs
        for request_id in scheduler_output.num_scheduled_tokens:
            request = requests[request_id]
            num_in_flight = request.num_output_placeholders
            if request.num_computed_tokens != request.num_tokens + num_in_flight:
                continue  # a prefill chunk that does not reach the end: it samples nothing
            if request.num_output_tokens + num_in_flight + 1 < stop_specs[request_id].max_num_output_tokens:
                request.num_output_placeholders = num_in_flight + 1
