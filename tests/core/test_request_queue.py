from __future__ import annotations

import pytest

from conveyor.config import SchedulingPolicy
from conveyor.core.request_queue import make_request_queue
from core_builders import make_request


def test_fcfs_order_prepend_and_remove() -> None:
    queue = make_request_queue(SchedulingPolicy.FCFS)
    a, b, c = (make_request(i) for i in "abc")
    for request in (a, b, c):
        queue.add(request)
    assert queue.peek() is a and len(queue) == 3
    assert queue.pop() is a
    queue.prepend(a)
    queue.remove(b)
    assert list(queue) == [a, c]
    with pytest.raises(ValueError):
        queue.remove(b)


def test_priority_order_by_priority_then_arrival() -> None:
    queue = make_request_queue(SchedulingPolicy.PRIORITY)
    late_urgent = make_request("late_urgent", priority=-1, arrival_s=5.0)
    early = make_request("early", priority=0, arrival_s=1.0)
    later = make_request("later", priority=0, arrival_s=2.0)
    for request in (later, early, late_urgent):
        queue.add(request)
    assert [r.request_id for r in queue] == ["late_urgent", "early", "later"]
    assert queue.pop() is late_urgent
    queue.prepend(late_urgent)
    assert queue.peek() is late_urgent
    queue.remove(early)
    assert [queue.pop(), queue.pop()] == [late_urgent, later]
    assert not queue


def test_unordered_holds_the_same_requests() -> None:
    for policy in SchedulingPolicy:
        queue = make_request_queue(policy)
        requests = [make_request(f"r{i}", priority=-i) for i in range(4)]
        for request in requests:
            queue.add(request)
        assert {id(r) for r in queue.unordered()} == {id(r) for r in requests}


def test_remove_all_keeps_order_of_the_rest() -> None:
    for policy in SchedulingPolicy:
        queue = make_request_queue(policy)
        requests = [make_request(f"r{i}", arrival_s=float(i)) for i in range(5)]
        for request in requests:
            queue.add(request)
        queue.remove_all([requests[1], requests[3]])
        assert [r.request_id for r in queue] == ["r0", "r2", "r4"]
