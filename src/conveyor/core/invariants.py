"""The scheduler's consistency checks, run by tests after every step (and by the engine behind a debug
flag). They read the scheduler through `SchedulerView`, the attributes they check, so this module
imports no scheduler and the scheduler imports it without a cycle."""

from __future__ import annotations

from typing import Protocol

from conveyor.config import SchedulerConfig
from conveyor.core.kv_cache_manager import KVCacheManager
from conveyor.core.request_queue import RequestQueue
from conveyor.request import Request, RequestStatus


class SchedulerView(Protocol):
    """What the checks read of a scheduler (`core.scheduler.Scheduler` has all of it)."""

    @property
    def scheduler_config(self) -> SchedulerConfig: ...

    @property
    def kv_cache_manager(self) -> KVCacheManager: ...

    @property
    def waiting(self) -> RequestQueue: ...

    @property
    def running(self) -> list[Request]: ...

    @property
    def requests(self) -> dict[str, Request]: ...

    @property
    def unsent_req_ids(self) -> set[str]: ...


def check_scheduler_invariants(scheduler: SchedulerView) -> None:
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
        assert request.num_output_placeholders == 0, "a waiting request has tokens in flight"
        assert not request.spec_token_ids, "a waiting request kept draft tokens"
        assert request.request_id not in manager.req_to_blocks, "a waiting request holds blocks"
    for request in scheduler.running:
        assert request.status is RequestStatus.RUNNING, request.status
        num_held = len(manager.req_to_blocks.get(request.request_id, ()))
        assert num_held >= manager.num_blocks_for(request.num_computed_tokens), "too few blocks"
        assert request.num_output_placeholders >= 0, "more tokens came back than were in flight"
        # Between schedule and update, a verifying request's drafts are counted as computed.
        num_known = request.num_tokens + request.num_output_placeholders + len(request.spec_token_ids)
        assert request.num_computed_tokens <= num_known, "computed beyond the known, in-flight and draft tokens"
