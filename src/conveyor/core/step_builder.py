"""The step being built by `Scheduler.schedule()`: what each scheduled request computes, in batch order.

A request scheduled earlier in the step may still become a preemption victim (priority policy, or the
FCFS victim a later request's allocation needs): `unschedule` then gives back everything it took --
its budget, its progress (num_computed_tokens), its prompt-token count, its worker data and its draft
tokens -- so the built `SchedulerOutput` holds only requests that really run.
"""

from __future__ import annotations

from conveyor.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from conveyor.request import Request


class StepBuilder:
    """The requests scheduled so far, in batch order, and the budget left."""

    def __init__(self, token_budget: int, now_s: float) -> None:
        self.token_budget = token_budget
        self.now_s = now_s
        self.num_scheduled_tokens: dict[str, int] = {}
        self.new_reqs: list[NewRequestData] = []
        self.cached_reqs = CachedRequestData()
        self.spec_decode_tokens: dict[str, list[int]] = {}  # drafts each request verifies this step
        self.preempted_req_ids: set[str] = set()
        self.num_preemptions = 0  # including requests the worker never saw (not in preempted_req_ids)
        self.num_prompt_tokens = 0  # prompt positions computed, recomputation included
        self._prompt_tokens_by_req: dict[str, int] = {}

    def add_new(self, request: Request, block_ids: list[int]) -> None:
        """A request (re)entering the worker travels whole: every known token and its full block table."""
        self.new_reqs.append(NewRequestData(
            request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
            output_token_ids=list(request.output_token_ids), sampling_params=request.sampling_params,
            block_ids=block_ids, num_computed_tokens=request.num_computed_tokens))
        if request.timings.first_scheduled_s is None:
            request.timings.first_scheduled_s = self.now_s

    def count_prompt_tokens(self, request_id: str, num_prompt_tokens: int) -> None:
        self.num_prompt_tokens += num_prompt_tokens
        self._prompt_tokens_by_req[request_id] = num_prompt_tokens

    def unschedule(self, request: Request) -> None:
        request_id = request.request_id
        self.spec_decode_tokens.pop(request_id, None)  # (recorded before its blocks were allocated)
        num_tokens = self.num_scheduled_tokens.pop(request_id, None)
        if num_tokens is None:
            return
        self.token_budget += num_tokens
        request.num_computed_tokens -= num_tokens  # back to what is really computed (freeing relies on it)
        self.num_prompt_tokens -= self._prompt_tokens_by_req.pop(request_id, 0)
        self.new_reqs[:] = [data for data in self.new_reqs if data.request_id != request_id]
        self.cached_reqs.remove(request_id)

    def build(self, finished_req_ids: set[str]) -> SchedulerOutput:
        return SchedulerOutput(
            scheduled_new_reqs=self.new_reqs, scheduled_cached_reqs=self.cached_reqs,
            num_scheduled_tokens=self.num_scheduled_tokens,
            total_num_scheduled_tokens=sum(self.num_scheduled_tokens.values()),
            finished_req_ids=finished_req_ids, preempted_req_ids=self.preempted_req_ids,
            scheduled_spec_decode_tokens=self.spec_decode_tokens)
