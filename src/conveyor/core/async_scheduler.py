"""Continuous batching with async scheduling: step N+1 is scheduled before step N's tokens are known.

Model: the engine launches step N+1, then applies step N's output (engine_core.AsyncEngineCore), so
when `schedule` runs, the tokens sampled by the step in flight are unknown. Each of them is stood in
for by a placeholder output token (`PLACEHOLDER_TOKEN_ID`) appended when its step is scheduled: the
request's known length then includes it, so the next step can compute it (the worker takes that
input id from the previous step's sampled tensor on the device) and everything else -- budget, block
slots, chunking -- is the synchronous scheduler unchanged. Placeholders are always the trailing output
tokens and resolve first in, first out: `update_from_output` takes them off, appends the real token
with the usual stop checks and puts back the ones still in flight. Invariants: a placeholder is never
hashed into the prefix cache (it is removed before any block is freed, and `free` indexes only known
tokens); a request whose in-flight token may be its last by length gets no placeholder, so it is not
scheduled again before that token is back (its known length equals its computed length); a request
preempted or finished while in flight drops its placeholders, and its in-flight token is ignored.
A stop token sampled in flight costs one wasted step for that request, as in vLLM.
"""

from __future__ import annotations

from conveyor.core.outputs import (
    PLACEHOLDER_TOKEN_ID,
    EngineCoreOutput,
    EngineCoreOutputs,
    ModelRunnerOutput,
    SchedulerOutput,
    TokenLogprobs,
)
from conveyor.core.scheduler import Scheduler
from conveyor.core.stats import SchedulerStats
from conveyor.core.step import StepBuilder
from conveyor.request import FinishReason, Request, RequestStatus

def drop_placeholders(request: Request) -> int:
    """Remove the request's trailing placeholders; returns how many there were."""
    output_token_ids = request.output_token_ids
    count = 0
    while output_token_ids and output_token_ids[-1] == PLACEHOLDER_TOKEN_ID:
        output_token_ids.pop()
        count += 1
    return count


class AsyncScheduler(Scheduler):
    """`Scheduler` plus placeholder bookkeeping for one step in flight."""

    def schedule(self) -> SchedulerOutput:
        scheduler_output = super().schedule()
        requests, stop_specs = self.requests, self.stop_specs
        for request_id in scheduler_output.num_scheduled_tokens:
            request = requests[request_id]
            if request.num_computed_tokens != request.num_tokens:
                continue  # a prefill chunk that does not reach the end: it samples nothing
            if len(request.output_token_ids) + 1 < stop_specs[request_id].max_num_output_tokens:
                request.output_token_ids.append(PLACEHOLDER_TOKEN_ID)
        return scheduler_output

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> tuple[EngineCoreOutputs, SchedulerStats]:
        """Resolve each request's oldest placeholder with its sampled token (stop checks as usual)."""
        now_s = self.clock()
        outputs = EngineCoreOutputs(finished_outputs=self.pending_outputs)
        self.pending_outputs = []
        requests, logprobs = self.requests, model_runner_output.logprobs
        num_unfinished, num_generated = len(requests), 0
        for request_id, token_ids in model_runner_output.sampled_token_ids.items():
            request = requests.get(request_id)
            if not token_ids or request is None or request.status is not RequestStatus.RUNNING:
                continue  # partial prefill chunk, or finished / preempted since it was scheduled
            num_in_flight = drop_placeholders(request)
            new_logprobs = logprobs.get(request_id, []) if logprobs else []
            num_generated += self._apply_tokens(request, token_ids, now_s, new_logprobs, outputs)
            if request.status is RequestStatus.RUNNING and num_in_flight > 1:
                request.output_token_ids.extend([PLACEHOLDER_TOKEN_ID] * (num_in_flight - 1))
        if len(requests) != num_unfinished:
            self.running = [request for request in self.running if request.status is RequestStatus.RUNNING]
        return outputs, self._take_stats(scheduler_output, num_generated, now_s)

    def _preempt(self, victim: Request, step: StepBuilder) -> None:
        drop_placeholders(victim)  # its in-flight token is dropped and recomputed after resumption
        super()._preempt(victim, step)

    def _finish(self, request: Request, reason: FinishReason, now_s: float, new_token_ids: list[int] | None = None,
                new_logprobs: list[TokenLogprobs] | None = None) -> EngineCoreOutput:
        drop_placeholders(request)
        return super()._finish(request, reason, now_s, new_token_ids, new_logprobs)
