"""Waiting queues: FCFS order, priority order, prepend and removal."""

from __future__ import annotations

import pytest

from services.common.sampling_params import SamplingParams
from services.scheduler.request import Request
from services.scheduler.request_queue import (
    FCFSRequestQueue,
    PriorityRequestQueue,
    SchedulingPolicy,
    create_request_queue,
)


def make(req_id: str, priority: int = 0, arrival_time: float = 0.0) -> Request:
    return Request(req_id, [1, 2, 3], SamplingParams(), priority=priority, arrival_time=arrival_time)


def ids(queue) -> list[str]:
    return [r.request_id for r in queue]


def test_create_request_queue_by_policy():
    assert isinstance(create_request_queue("fcfs"), FCFSRequestQueue)
    assert isinstance(create_request_queue(SchedulingPolicy.PRIORITY), PriorityRequestQueue)
    with pytest.raises(ValueError):
        create_request_queue("lifo")


def test_fcfs_order_prepend_and_remove():
    q = create_request_queue("fcfs")
    assert not q and len(q) == 0
    a, b, c, d, e = (make(x) for x in "abcde")
    for r in (a, b, c):
        q.add_request(r)
    assert q and len(q) == 3 and ids(q) == ["a", "b", "c"]
    assert q.peek_request() is a
    assert q.pop_request() is a
    q.prepend_request(a)
    assert ids(q) == ["a", "b", "c"]
    q.prepend_request(e)
    q.prepend_request(d)
    assert ids(q) == ["d", "e", "a", "b", "c"]
    q.remove_request(a)
    assert ids(q) == ["d", "e", "b", "c"]
    q.remove_requests([c, d, make("not-queued")])
    assert ids(q) == ["e", "b"]
    with pytest.raises(ValueError, match="'a' is not in the queue"):
        q.remove_request(a)
    assert [q.pop_request().request_id for _ in range(2)] == ["e", "b"]
    with pytest.raises(IndexError):
        q.pop_request()
    with pytest.raises(IndexError):
        q.peek_request()


def test_priority_order_ties_by_arrival_then_insertion():
    q = create_request_queue("priority")
    reqs = [
        make("late-low", priority=0, arrival_time=5.0),
        make("early-high", priority=1, arrival_time=1.0),
        make("early-low", priority=0, arrival_time=2.0),
        make("tie-1", priority=0, arrival_time=5.0),
        make("urgent", priority=-1, arrival_time=9.0),
    ]
    for r in reqs:
        q.add_request(r)
    assert ids(q) == ["urgent", "early-low", "late-low", "tie-1", "early-high"]
    assert q.peek_request().request_id == "urgent"
    urgent = q.pop_request()
    early_low = q.pop_request()
    assert early_low.request_id == "early-low"
    # A preempted request goes back to its place, ahead of later arrivals.
    q.prepend_request(early_low)
    q.prepend_request(urgent)
    assert ids(q) == ["urgent", "early-low", "late-low", "tie-1", "early-high"]
    q.remove_request(reqs[0])
    assert ids(q) == ["urgent", "early-low", "tie-1", "early-high"]
    q.remove_requests([urgent, reqs[1]])
    assert ids(q) == ["early-low", "tie-1"]
    assert len(q) == 2 and q
    with pytest.raises(ValueError, match="'late-low' is not in the queue"):
        q.remove_request(reqs[0])
    assert [q.pop_request().request_id for _ in range(2)] == ["early-low", "tie-1"]
    assert not q
    with pytest.raises(IndexError):
        q.peek_request()
