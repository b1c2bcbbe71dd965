"""Preemption by recompute in an 11-block pool (10 usable blocks of 16 tokens).

Two 80-token prompts take 5 blocks each; the first decode step needs a sixth
block for one of them, so someone is preempted.
"""

from __future__ import annotations

from services.common.engine import EngineCoreRequest
from services.common.model_runner_output import ModelRunnerOutput
from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import SchedulerOutput
from services.scheduler.config import SchedulerConfig
from services.scheduler.invariants import check_invariants
from services.scheduler.kv_store import InMemoryKVStore
from services.scheduler.request import RequestStatus
from services.scheduler.scheduler import Scheduler


def make_request(req_id: str, first_token: int, num_tokens: int, *, priority: int = 0,
                 arrival_time: float = 0.0, max_tokens: int = 20) -> EngineCoreRequest:
    prompt = list(range(first_token, first_token + num_tokens))
    return EngineCoreRequest(req_id, prompt, SamplingParams(max_tokens=max_tokens),
                             arrival_time=arrival_time, priority=priority)


def step(scheduler: Scheduler) -> SchedulerOutput:
    """schedule() + update_from_output(), sampling token 7 once a prompt is done."""
    scheduler_output = scheduler.schedule()
    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        sampled.append([7] if request.num_computed_tokens == request.num_tokens else [])
    scheduler.update_from_output(
        scheduler_output, ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled))
    check_invariants(scheduler)
    return scheduler_output


def waiting_ids(scheduler: Scheduler) -> list[str]:
    return [r.request_id for r in scheduler.waiting]


def assert_no_leak(scheduler: Scheduler) -> None:
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks - 1
    assert all(block.ref_cnt == 0 for block in kv.block_pool.blocks)
    assert kv.req_to_blocks == {}


def test_fcfs_preempts_the_latest_and_resumes_it_first():
    scheduler = Scheduler(SchedulerConfig(num_blocks=11), InMemoryKVStore())
    scheduler.add_request(make_request("a", 1000, 80))
    scheduler.add_request(make_request("b", 2000, 80))
    scheduler.add_request(make_request("c", 3000, 8, max_tokens=3))

    first = step(scheduler)
    assert [(r.req_id, r.block_ids) for r in first.scheduled_new_reqs] == [
        ("a", [1, 2, 3, 4, 5]), ("b", [6, 7, 8, 9, 10])]
    assert waiting_ids(scheduler) == ["c"]  # no block left for it

    # "a" needs a sixth block: "b" (the last running) is preempted. Its blocks
    # go to the free-queue tail tail-first, so "a" takes b's last block, 10.
    second = step(scheduler)
    assert second.num_scheduled_tokens == {"a": 1}
    assert second.scheduled_cached_reqs.new_block_ids == [[10]]
    assert waiting_ids(scheduler) == ["b", "c"]  # the victim is at the FRONT
    b = scheduler.requests["b"]
    assert (b.status, b.num_computed_tokens, b.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert scheduler.make_stats().num_preemptions == 1

    # "a" decodes alone (taking block 9 at token 97) until it finishes after 20 tokens.
    steps = [step(scheduler) for _ in range(18)]
    assert all(s.num_scheduled_tokens == {"a": 1} for s in steps)
    assert steps[15].scheduled_cached_reqs.new_block_ids == [[9]]
    assert waiting_ids(scheduler) == ["b", "c"]

    # "b" resumes before "c": blocks 6, 7, 8 are still cached (48 tokens), 9, 10
    # were evicted by "a", so 81 - 48 tokens are recomputed in three new blocks.
    resumed = step(scheduler)
    assert resumed.num_scheduled_tokens == {"b": 33, "c": 8}
    cached = resumed.scheduled_cached_reqs
    assert (cached.req_ids, cached.resumed_from_preemption) == (["b"], [True])
    assert cached.new_block_ids == [[6, 7, 8, 9, 10, 5]]  # ALL block ids: they replace
    assert cached.num_computed_tokens == [48]
    assert [(r.req_id, r.block_ids) for r in resumed.scheduled_new_reqs] == [("c", [4])]
    assert scheduler.requests["b"].num_cached_tokens == 0  # set on the FIRST schedule only

    while scheduler.has_requests():
        step(scheduler)
    assert_no_leak(scheduler)


def test_priority_preempts_the_low_priority_request():
    scheduler = Scheduler(SchedulerConfig(num_blocks=11, policy="priority"), InMemoryKVStore())
    scheduler.add_request(make_request("low", 1000, 80, priority=1, arrival_time=0.0))
    scheduler.add_request(make_request("high", 2000, 80, priority=0, arrival_time=1.0))
    first = step(scheduler)
    # The priority queue admits "high" first.
    assert [(r.req_id, r.block_ids) for r in first.scheduled_new_reqs] == [
        ("high", [1, 2, 3, 4, 5]), ("low", [6, 7, 8, 9, 10])]

    second = step(scheduler)
    assert second.num_scheduled_tokens == {"high": 1}
    assert second.scheduled_cached_reqs.new_block_ids == [[10]]
    assert waiting_ids(scheduler) == ["low"]
    assert scheduler.requests["low"].status == RequestStatus.PREEMPTED

    while scheduler.has_requests():
        step(scheduler)
    assert_no_leak(scheduler)


def test_priority_victim_scheduled_earlier_in_the_step_gives_its_tokens_back():
    scheduler = Scheduler(SchedulerConfig(num_blocks=11, policy="priority"), InMemoryKVStore())
    scheduler.add_request(make_request("low", 1000, 80, priority=1))
    step(scheduler)  # low: blocks 1..5
    scheduler.add_request(make_request("high", 2000, 64, priority=0))
    second = step(scheduler)  # low takes block 6 for token 81; high takes 7..10
    assert second.num_scheduled_tokens == {"low": 1, "high": 64}
    assert [r.request_id for r in scheduler.running] == ["low", "high"]

    # "low" is scheduled first (no new block needed), then "high" needs a block:
    # the victim is "low", already scheduled this step, so it is unscheduled.
    third = step(scheduler)
    assert third.num_scheduled_tokens == {"high": 1}
    assert third.total_num_scheduled_tokens == 1
    assert third.scheduled_cached_reqs.req_ids == ["high"]
    assert third.scheduled_cached_reqs.new_block_ids == [[6]]  # low's freed tail block
    assert waiting_ids(scheduler) == ["low"]
    assert scheduler.requests["low"].num_computed_tokens == 0

    while scheduler.has_requests():
        step(scheduler)
    assert_no_leak(scheduler)


def test_aborting_a_preempted_request_tells_the_worker():
    scheduler = Scheduler(SchedulerConfig(num_blocks=11), InMemoryKVStore())
    scheduler.add_request(make_request("a", 1000, 80))
    scheduler.add_request(make_request("b", 2000, 80))
    step(scheduler)
    step(scheduler)
    assert waiting_ids(scheduler) == ["b"]
    scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    check_invariants(scheduler)
    assert waiting_ids(scheduler) == []
    assert "b" in scheduler.schedule().finished_req_ids
