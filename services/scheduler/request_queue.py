"""The waiting queue: first come first served, or by priority.

Both queues hold requests that are not running: new ones and ones preempted
by recompute. ``prepend_request`` is how a preempted request goes back: to the
front under FCFS, to its place by (priority, arrival_time) under the priority
policy (which is where it came from).
"""

from __future__ import annotations

import enum
import heapq
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.scheduler.request import Request


class SchedulingPolicy(str, enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


class RequestQueue(ABC):
    """What the scheduler needs from a waiting queue."""

    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Adds a newly arrived request."""

    @abstractmethod
    def pop_request(self) -> Request:
        """Removes and returns the request that runs next; IndexError when empty."""

    @abstractmethod
    def peek_request(self) -> Request:
        """Returns the request that runs next without removing it; IndexError when empty."""

    @abstractmethod
    def prepend_request(self, request: Request) -> None:
        """Puts back a request that was taken out (preempted): it runs before later arrivals."""

    @abstractmethod
    def remove_request(self, request: Request) -> None:
        """Removes one request; ValueError if it is not queued."""

    @abstractmethod
    def remove_requests(self, requests: Iterable[Request]) -> None:
        """Removes every given request that is queued (others are ignored), in one pass."""

    @abstractmethod
    def __len__(self) -> int: ...

    def __bool__(self) -> bool:
        return len(self) > 0

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Yields requests in the order they would run."""


class FCFSRequestQueue(RequestQueue):
    """Arrival order; preempted requests go back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._queue.append(request)

    def pop_request(self) -> Request:
        if not self._queue:
            raise IndexError("pop from an empty request queue")
        return self._queue.popleft()

    def peek_request(self) -> Request:
        if not self._queue:
            raise IndexError("peek at an empty request queue")
        return self._queue[0]

    def prepend_request(self, request: Request) -> None:
        self._queue.appendleft(request)

    def remove_request(self, request: Request) -> None:
        # By identity: a Request's own equality is not what "this one" means.
        for i, queued in enumerate(self._queue):
            if queued is request:
                del self._queue[i]
                return
        raise ValueError(f"request {request.request_id!r} is not in the queue")

    def remove_requests(self, requests: Iterable[Request]) -> None:
        to_remove = {id(r) for r in requests}
        if to_remove:
            self._queue = deque(r for r in self._queue if id(r) not in to_remove)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue(RequestQueue):
    """A heap by (priority, arrival_time): lower priority values run first.

    Ties on both keys are broken by insertion order so the queue is
    deterministic. Putting a preempted request back is a plain insert: its
    keys already place it ahead of anything that arrived after it.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._num_inserted = 0

    def add_request(self, request: Request) -> None:
        self._num_inserted += 1
        entry = (request.priority, request.arrival_time, self._num_inserted, request)
        heapq.heappush(self._heap, entry)

    def pop_request(self) -> Request:
        if not self._heap:
            raise IndexError("pop from an empty request queue")
        return heapq.heappop(self._heap)[-1]

    def peek_request(self) -> Request:
        if not self._heap:
            raise IndexError("peek at an empty request queue")
        return self._heap[0][-1]

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)

    def remove_request(self, request: Request) -> None:
        for i, entry in enumerate(self._heap):
            if entry[-1] is request:
                break
        else:
            raise ValueError(f"request {request.request_id!r} is not in the queue")
        self._heap[i] = self._heap[-1]
        self._heap.pop()
        heapq.heapify(self._heap)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        to_remove = {id(r) for r in requests}
        if to_remove:
            self._heap = [e for e in self._heap if id(e[-1]) not in to_remove]
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        # Entries never tie (the insertion count is unique), so requests are never compared.
        return (entry[-1] for entry in sorted(self._heap))


def create_request_queue(policy: SchedulingPolicy | str) -> RequestQueue:
    """Returns an empty queue for ``policy`` ("fcfs" or "priority")."""
    policy = SchedulingPolicy(policy)
    if policy is SchedulingPolicy.PRIORITY:
        return PriorityRequestQueue()
    return FCFSRequestQueue()
