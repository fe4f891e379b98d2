"""Speculative decoding, the scheduler's half: draft tokens are just more tokens a request asks of a step.

Model (vLLM V1): with each step's sampled tokens the worker returns drafts for each request's next
step (`ModelRunnerOutput.spec_token_ids`); the scheduler keeps them on the request
(`Request.spec_token_ids`) and its running pass widens the request's gap by them, so a decode is
scheduled 1 + len(drafts) tokens, counted in max_num_batched_tokens, with KV slots for all of them and,
for a draft model, `num_lookahead_tokens` more past them (the draft writes its next proposals' KV
there). Drafts are trimmed before they are counted: first to what max_tokens and max_model_len leave (a
step emits at most 1 + len(drafts) tokens, so it never emits past the limit), then by the prefill
threshold and the budget. num_computed_tokens advances by every scheduled token, as for any step;
after the step `apply_verification` takes the rejected drafts back (num_computed_tokens = before +
num_scheduled - (len(drafts) - num_accepted)), so the slots they used stay held and the next step
overwrites them: a rejection frees and takes no block. Drafts never enter output_token_ids and only
known tokens are hashed, so an unverified token never reaches the prefix cache; the kept tokens are
appended one by one with the usual stop checks, so a stop token among the accepted ones ends the
request there, as sequential decoding would. A preempted request drops its drafts (it is recomputed and
drafts again); an aborted one drops everything.
"""

from __future__ import annotations

from collections.abc import Mapping

from conveyor.core.outputs import ModelRunnerOutput, SchedulerOutput
from conveyor.core.stats import SpecDecodingStats
from conveyor.request import Request, RequestStatus


def num_drafts_allowed(request: Request, max_num_output_tokens: int) -> int:
    """Drafts a step of this request may verify without emitting past its length limit: the step
    emits the accepted drafts and one token of the target's own."""
    return max_num_output_tokens - len(request.output_token_ids) - request.num_output_placeholders - 1


def num_lookahead_slots(num_tokens_after: int, max_num_slots: int, num_lookahead_tokens: int) -> int:
    """Slots to reserve past a step's tokens for the draft model's proposals, capped at the request's
    last useful slot (`max_num_slots`, its length limit minus one: drafts past it would be trimmed)."""
    return max(0, min(num_lookahead_tokens, max_num_slots - num_tokens_after))


def apply_verification(requests: Mapping[str, Request], scheduler_output: SchedulerOutput,
                       runner_output: ModelRunnerOutput, num_spec_tokens: int) -> SpecDecodingStats:
    """Take back each verifying request's rejected drafts (before its kept tokens are appended) and
    count what verification accepted. A request that sampled nothing (contract says it cannot)
    recomputes the whole step: its count goes back by all its scheduled tokens."""
    stats = SpecDecodingStats(num_spec_tokens=num_spec_tokens)
    sampled_token_ids = runner_output.sampled_token_ids
    for request_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
        request = requests.get(request_id)
        if request is None or request.status is not RequestStatus.RUNNING:
            continue  # finished or preempted since it was scheduled: nothing to take back
        request.spec_token_ids = []  # verified now; the step's proposals (if any) come next
        num_sampled = len(sampled_token_ids.get(request_id, ()))
        request.num_computed_tokens -= len(drafts) + 1 - num_sampled
        if num_sampled:
            stats.observe_draft(num_draft_tokens=len(drafts), num_accepted_tokens=num_sampled - 1)
    return stats


def store_drafts(requests: Mapping[str, Request], spec_token_ids: Mapping[str, list[int]]) -> None:
    """Keep each running request's drafts for its next step (finished ones drop theirs)."""
    for request_id, drafts in spec_token_ids.items():
        request = requests.get(request_id)
        if request is not None and request.status is RequestStatus.RUNNING:
            request.spec_token_ids = drafts  # the runner's list: trimmed by slicing, never mutated
