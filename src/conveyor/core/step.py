"""One step under construction: the token budget, what was scheduled, and the SchedulerOutput it becomes.

Scheduling a request advances its `num_computed_tokens` at once (vLLM V1: progress is counted at
schedule time, so the next step starts from it even before the model has run) and records what the
worker needs: a `NewRequestData` for a request it does not hold, an entry in the step's one
`CachedRequestData` (parallel lists) otherwise. An
entry can be withdrawn (`unschedule`) when a request scheduled earlier in the step becomes a preemption
victim (possible under the priority policy): its progress, the budget and the counters are given back.
"""

from __future__ import annotations

from conveyor.core.outputs import NO_NEW_BLOCKS, CachedRequestData, NewRequestData, SchedulerOutput
from conveyor.request import Request


class StepBuilder:
    """The requests scheduled so far in this step, in batch order."""

    def __init__(self, token_budget: int, now_s: float) -> None:
        self.token_budget = token_budget
        self.now_s = now_s
        self.num_scheduled_tokens: dict[str, int] = {}
        self.new_reqs: list[NewRequestData] = []
        self.cached_reqs = CachedRequestData()
        self.preempted_req_ids: set[str] = set()
        self.num_preemptions = 0  # including requests the worker never saw (not in preempted_req_ids)
        self.num_prompt_tokens = 0  # prompt positions computed, recomputation included
        self._prompt_tokens_by_req: dict[str, int] = {}

    def schedule_cached(self, request: Request, num_new_tokens: int, new_block_ids: list[int]) -> None:
        """A request the worker holds: it gets only the blocks appended this step."""
        request_id = request.request_id
        num_computed = request.num_computed_tokens
        self.cached_reqs.append(request_id, new_block_ids or NO_NEW_BLOCKS, num_computed)
        self.num_scheduled_tokens[request_id] = num_new_tokens
        self.token_budget -= num_new_tokens
        if num_computed < len(request.prompt_token_ids):
            self._count_prompt_tokens(request, num_new_tokens)
        request.num_computed_tokens = num_computed + num_new_tokens

    def schedule_new(self, request: Request, num_new_tokens: int, block_ids: list[int]) -> None:
        """A request (re)entering the worker: everything it needs, with its full block table."""
        request_id = request.request_id
        num_computed = request.num_computed_tokens
        self.new_reqs.append(NewRequestData(request_id, request.prompt_token_ids, list(request.output_token_ids),
                                            request.sampling_params, block_ids, num_computed))
        self.num_scheduled_tokens[request_id] = num_new_tokens
        self.token_budget -= num_new_tokens
        if num_computed < len(request.prompt_token_ids):
            self._count_prompt_tokens(request, num_new_tokens)
        if request.timings.first_scheduled_s is None:
            request.timings.first_scheduled_s = self.now_s
        request.num_computed_tokens = num_computed + num_new_tokens

    def _count_prompt_tokens(self, request: Request, num_new_tokens: int) -> None:
        num_computed = request.num_computed_tokens
        num_prompt = min(num_computed + num_new_tokens, len(request.prompt_token_ids)) - num_computed
        self.num_prompt_tokens += num_prompt
        self._prompt_tokens_by_req[request.request_id] = num_prompt

    def unschedule(self, request: Request) -> None:
        request_id = request.request_id
        num_tokens = self.num_scheduled_tokens.pop(request_id, None)
        if num_tokens is None:
            return
        self.token_budget += num_tokens
        request.num_computed_tokens -= num_tokens  # back to what is really computed (freeing relies on it)
        self.num_prompt_tokens -= self._prompt_tokens_by_req.pop(request_id, 0)
        self.new_reqs[:] = [data for data in self.new_reqs if data.request_id != request_id]
        self.cached_reqs.remove(request_id)

    def build(self, finished_req_ids: set[str]) -> SchedulerOutput:
        total = sum(self.num_scheduled_tokens.values())
        return SchedulerOutput(self.new_reqs, self.cached_reqs, self.num_scheduled_tokens, total,
                               finished_req_ids, self.preempted_req_ids)
