"""The scheduler's consistency checks, run by tests after every step (and by the engine behind a debug flag)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from conveyor.request import RequestStatus

if TYPE_CHECKING:
    from conveyor.core.scheduler_state import SchedulerState


def check_scheduler_invariants(scheduler: SchedulerState) -> None:
    """Block-pool invariants, and every unfinished request in exactly one consistent place."""
    manager = scheduler.kv_cache_manager
    manager.check_invariants()
    waiting = list(scheduler.waiting)
    placed = [request.request_id for request in waiting + scheduler.running]
    assert len(placed) == len(set(placed)), "a request is queued or running twice"
    assert set(placed) == set(scheduler.requests), "requests lost, or finished ones still tracked"
    assert len(scheduler.running) <= scheduler.scheduler_config.max_num_seqs, "too many running requests"
    assert scheduler.unsent_req_ids <= {request.request_id for request in scheduler.running}
    for request in waiting:
        assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), request.status
        assert request.num_computed_tokens == 0, "a waiting request claims computed tokens"
        assert request.request_id not in manager.req_to_blocks, "a waiting request holds blocks"
    for request in scheduler.running:
        assert request.status is RequestStatus.RUNNING, request.status
        num_held = len(manager.req_to_blocks.get(request.request_id, ()))
        assert num_held >= manager.num_blocks_for(request.num_computed_tokens), "too few blocks"
        assert request.num_computed_tokens <= request.num_tokens, "computed beyond known tokens"
