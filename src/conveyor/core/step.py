"""One step under construction: the token budget, what was scheduled, and the SchedulerOutput it becomes.

Entries can be withdrawn (`unschedule`) when a request scheduled earlier in the step is chosen as a
preemption victim (possible under the priority policy); its tokens go back to the budget. Nothing on a
request changes until `build`, which advances `num_computed_tokens` (vLLM V1: progress is counted at
schedule time, so the next step starts from it even before the model has run).
"""

from __future__ import annotations

from collections.abc import Callable

from conveyor.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from conveyor.request import Request


class StepBuilder:
    """The requests scheduled so far in this step, in batch order."""

    def __init__(self, token_budget: int) -> None:
        self.token_budget = token_budget
        self.num_scheduled_tokens: dict[str, int] = {}
        # request id -> (request, tokens, blocks taken this step, worker has not seen it)
        self.entries: dict[str, tuple[Request, int, list[int], bool]] = {}
        self.preempted_req_ids: set[str] = set()
        self.num_preemptions = 0  # including requests the worker never saw (not in preempted_req_ids)

    def schedule(self, request: Request, num_new_tokens: int, new_block_ids: list[int], is_new: bool) -> None:
        self.token_budget -= num_new_tokens
        self.num_scheduled_tokens[request.request_id] = num_new_tokens
        self.entries[request.request_id] = (request, num_new_tokens, new_block_ids, is_new)

    def unschedule(self, request: Request) -> None:
        entry = self.entries.pop(request.request_id, None)
        if entry is not None:
            self.token_budget += entry[1]
            del self.num_scheduled_tokens[request.request_id]

    def build(self, get_block_ids: Callable[[str], list[int]], now_s: float,
              finished_req_ids: set[str]) -> tuple[SchedulerOutput, int]:
        """Advance every scheduled request and return the output plus the prompt tokens computed."""
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        num_prompt_tokens = 0
        total = 0
        for request_id, (request, num_new_tokens, new_block_ids, is_new) in self.entries.items():
            num_computed = request.num_computed_tokens
            num_prompt = len(request.prompt_token_ids)
            if num_computed < num_prompt:  # prompt positions computed (recomputation included)
                num_prompt_tokens += min(num_computed + num_new_tokens, num_prompt) - num_computed
            if is_new:
                new_reqs.append(NewRequestData(
                    request_id, request.prompt_token_ids, list(request.output_token_ids),
                    request.sampling_params, get_block_ids(request_id), num_computed))
                if request.timings.first_scheduled_s is None:
                    request.timings.first_scheduled_s = now_s
            else:
                cached_reqs.append(CachedRequestData(request_id, new_block_ids, num_computed))
            request.num_computed_tokens = num_computed + num_new_tokens
            total += num_new_tokens
        output = SchedulerOutput(new_reqs, cached_reqs, self.num_scheduled_tokens, total,
                                 finished_req_ids, self.preempted_req_ids)
        return output, num_prompt_tokens
