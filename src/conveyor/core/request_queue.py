"""Waiting queues: first-come-first-served and priority, behind one interface.

FCFS is a deque in arrival order; a preempted request is put back at the front so it resumes before
anything that arrived after it. The priority queue is a heap ordered by (priority, arrival, sequence
number): a lower priority value is served first (vLLM's convention), ties by arrival, then by insertion.
A preempted request re-enters the heap with its original key, so it too goes ahead of later arrivals.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator

from conveyor.config import SchedulingPolicy
from conveyor.request import Request


class RequestQueue(ABC):
    """The waiting requests, in the order the scheduler should consider them."""

    @abstractmethod
    def add(self, request: Request) -> None:
        """Enqueue a newly arrived request."""

    @abstractmethod
    def prepend(self, request: Request) -> None:
        """Put a preempted request back where it resumes first among its peers."""

    @abstractmethod
    def peek(self) -> Request:
        """The next request (IndexError when empty)."""

    @abstractmethod
    def pop(self) -> Request:
        """Remove and return the next request (IndexError when empty)."""

    @abstractmethod
    def remove(self, request: Request) -> None:
        """Remove a request from anywhere in the queue (abort, timeout); O(n)."""

    @abstractmethod
    def remove_all(self, requests: list[Request]) -> None:
        """Remove several requests at once in O(n) (a burst of queue timeouts under overload)."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """The requests in service order."""

    @abstractmethod
    def unordered(self) -> Iterator[Request]:
        """The requests in no particular order (cheap: no sort), for scans such as queue timeouts."""

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSRequestQueue(RequestQueue):
    def __init__(self) -> None:
        self._requests: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._requests.append(request)

    def prepend(self, request: Request) -> None:
        self._requests.appendleft(request)

    def peek(self) -> Request:
        return self._requests[0]

    def pop(self) -> Request:
        return self._requests.popleft()

    def remove(self, request: Request) -> None:
        for index, queued in enumerate(self._requests):
            if queued is request:  # identity: Request's dataclass __eq__ compares every field
                del self._requests[index]
                return
        raise ValueError(f"request {request.request_id} is not waiting")

    def remove_all(self, requests: list[Request]) -> None:
        doomed = {id(request) for request in requests}
        self._requests = deque(request for request in self._requests if id(request) not in doomed)

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)

    def unordered(self) -> Iterator[Request]:
        return iter(self._requests)


class PriorityRequestQueue(RequestQueue):
    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._num_pushed = 0

    def add(self, request: Request) -> None:
        self._num_pushed += 1
        heapq.heappush(self._heap, (request.priority, request.arrival_s, self._num_pushed, request))

    def prepend(self, request: Request) -> None:
        self.add(request)  # its (priority, arrival) key already places it ahead of later arrivals

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        for index, entry in enumerate(self._heap):
            if entry[3] is request:
                self._heap[index] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError(f"request {request.request_id} is not waiting")

    def remove_all(self, requests: list[Request]) -> None:
        doomed = {id(request) for request in requests}
        self._heap = [entry for entry in self._heap if id(entry[3]) not in doomed]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap, key=lambda entry: entry[:3]))

    def unordered(self) -> Iterator[Request]:
        return (entry[3] for entry in self._heap)


def make_request_queue(policy: SchedulingPolicy) -> RequestQueue:
    if policy is SchedulingPolicy.FCFS:
        return FCFSRequestQueue()
    if policy is SchedulingPolicy.PRIORITY:
        return PriorityRequestQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}")


def remove_by_identity(requests: list[Request], request: Request) -> None:
    """Remove from a list by identity (Request's dataclass __eq__ would compare every field)."""
    for index, candidate in enumerate(requests):
        if candidate is request:
            del requests[index]
            return
    raise ValueError(f"request {request.request_id} is not in the list")
