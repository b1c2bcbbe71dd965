"""Randomized scheduling runs with small pools, checking every invariant every step.

Thousands of requests with random lengths (1..200), prompts built from a few
shared prefixes (prefix hits), random stop settings, random aborts, both
policies, and pools small enough that preemption and IGNORED prompts happen.
A tiny simulated worker samples a random token for every scheduled request
whose prompt is complete after the step. Beyond the structural invariants,
each request's outputs are checked against an oracle: the tokens received are
exactly the tokens sampled, and the finish reason is the one the stop rules
give for that token sequence.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from services.common.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
from services.common.limits import SchedulingLimits
from services.common.model_runner_output import ModelRunnerOutput
from services.common.sampling_params import SamplingParams
from services.common.stats import SchedulerStats
from services.scheduler.config import SchedulerConfig
from services.scheduler.invariants import check_invariants
from services.scheduler.kv_store import InMemoryKVStore, KVStore, RedisKVStore
from services.scheduler.request import RequestStatus
from services.scheduler.scheduler import Scheduler

EOS = 2
STOP_ID = 5
VOCAB = 40  # sampled tokens are 0..VOCAB-1, so EOS and STOP_ID come up often


@dataclass
class Expected:
    """What the test knows about one request, to check its outputs against."""

    request: EngineCoreRequest
    sampled: list[int] = field(default_factory=list)
    received: list[int] = field(default_factory=list)
    final: EngineCoreOutput | None = None
    aborted: bool = False


def random_config(rng: random.Random, policy: str) -> SchedulerConfig:
    return SchedulerConfig(
        num_blocks=rng.randint(8, 24),  # 7..23 usable blocks: 112..368 tokens
        limits=SchedulingLimits(max_num_batched_tokens=rng.choice([24, 64, 256]),
                                max_num_seqs=rng.randint(2, 12)),
        max_model_len=rng.choice([160, 256]),
        long_prefill_token_threshold=rng.choice([0, 0, 16, 48]),
        policy=policy,
        enable_prefix_caching=rng.random() < 0.9,
    )


def random_request(rng: random.Random, req_id: str, prefixes: list[list[int]],
                   arrival_time: float) -> EngineCoreRequest:
    length = rng.randint(1, 200)
    prompt = rng.choice(prefixes)[: rng.randint(0, length)] if rng.random() < 0.7 else []
    prompt += [rng.randint(100, 999) for _ in range(length - len(prompt))]
    params = SamplingParams(
        max_tokens=rng.choice([None, rng.randint(1, 40)]),
        min_tokens=rng.choice([0, 0, rng.randint(0, 5)]),
        stop_token_ids=[STOP_ID] if rng.random() < 0.3 else [],
        ignore_eos=rng.random() < 0.1,
    )
    return EngineCoreRequest(req_id, prompt, params, eos_token_id=EOS, arrival_time=arrival_time,
                             priority=rng.randint(0, 3), cache_salt=rng.choice([None, None, "s"]))


def check_finished_correctly(exp: Expected, max_model_len: int) -> None:
    """The oracle: the stop rules applied to the received tokens give this finish."""
    final, params = exp.final, exp.request.sampling_params
    assert final is not None, f"{exp.request.request_id} never finished"
    tokens = exp.received
    assert tokens == exp.sampled, f"{exp.request.request_id}: received {tokens}, sampled {exp.sampled}"
    if final.finish_message:  # IGNORED: never scheduled
        assert final.finish_reason == FinishReason.LENGTH and tokens == []
        return
    stops = {STOP_ID} & set(params.stop_token_ids)
    if not params.ignore_eos:
        stops.add(EOS)
    for i, token_id in enumerate(tokens[:-1]):
        assert i + 1 < params.min_tokens or token_id not in stops, (
            f"{exp.request.request_id} went on after stop token {token_id} at output {i}")
    last_is_stop = len(tokens) >= params.min_tokens and tokens[-1] in stops
    if last_is_stop:
        assert final.finish_reason == FinishReason.STOP
        assert final.stop_reason == (None if tokens[-1] == EOS and EOS in stops else tokens[-1])
    else:
        assert final.finish_reason == FinishReason.LENGTH
        num_tokens = len(exp.request.prompt_token_ids) + len(tokens)
        assert len(tokens) == params.max_tokens or num_tokens == max_model_len, (
            f"{exp.request.request_id} LENGTH capped at {len(tokens)} outputs, {num_tokens} tokens")


def run_random_workload(seed: int, policy: str, num_requests: int, store: KVStore) -> SchedulerStats:
    """Runs requests to completion, checking invariants after every step."""
    rng = random.Random(seed)
    scheduler = Scheduler(random_config(rng, policy), store)
    prefixes = [[rng.randint(100, 999) for _ in range(96)] for _ in range(3)]
    expected: dict[str, Expected] = {}
    step_id = 0
    while len(expected) < num_requests or scheduler.has_requests():
        step_id += 1
        assert step_id < 100 * num_requests, "no progress"
        # Closed loop: arrivals pause while 24 requests are live, so queues stay short.
        room = len(expected) < num_requests and scheduler.get_num_unfinished_requests() < 24
        for _ in range(rng.choice([0, 0, 1, 2, 3]) if room else 0):
            req = random_request(rng, f"r{len(expected)}", prefixes, arrival_time=step_id)
            expected[req.request_id] = Expected(req)
            scheduler.add_request(req)

        num_preemptions = scheduler.make_stats().num_preemptions
        scheduler_output = scheduler.schedule()
        check_invariants(scheduler, check_store=False)  # the store catches up at commit
        if scheduler.make_stats().num_preemptions > num_preemptions:
            # A step that preempted admits nothing from the waiting queue.
            assert not scheduler_output.scheduled_new_reqs
            assert not any(scheduler_output.scheduled_cached_reqs.resumed_from_preemption)
        if rng.random() < 0.02 and scheduler.requests:
            abort(scheduler, expected, rng.choice(list(scheduler.requests)))
        runner_output = ModelRunnerOutput()
        for req_id in scheduler_output.num_scheduled_tokens:
            request = scheduler.requests.get(req_id)
            done = request is not None and request.num_computed_tokens == request.num_tokens
            token_ids = [rng.randrange(VOCAB)] if done else []
            if done:
                expected[req_id].sampled += token_ids
            runner_output.req_ids.append(req_id)
            runner_output.sampled_token_ids.append(token_ids)
        for outputs in scheduler.update_from_output(scheduler_output, runner_output).values():
            for out in outputs.outputs:
                exp = expected[out.request_id]
                assert exp.final is None, f"output for finished request {out.request_id}"
                exp.received += out.new_token_ids
                if out.finished:
                    exp.final = out
        check_invariants(scheduler)
        if rng.random() < 0.05 and scheduler.requests:
            abort(scheduler, expected, rng.choice(list(scheduler.requests)), "unknown-id")
            # The abort reaches the store with the next update_from_output.
            check_invariants(scheduler, check_store=False)

    for exp in expected.values():
        if not exp.aborted:
            check_finished_correctly(exp, scheduler.max_model_len)
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks - 1
    assert all(block.ref_cnt == 0 for block in kv.block_pool.blocks)
    return scheduler.make_stats()


def abort(scheduler: Scheduler, expected: dict[str, Expected], *req_ids: str) -> None:
    scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)
    for req_id in req_ids:
        if req_id in expected:
            expected[req_id].aborted = True


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_random_workload_in_memory(policy: str):
    stats = [run_random_workload(seed, policy, num_requests=400, store=InMemoryKVStore())
             for seed in range(4)]
    # The workload really exercises preemption and prefix hits.
    assert sum(s.num_preemptions for s in stats) > 0
    assert sum(s.prefix_cache_hits for s in stats) > 0


def test_random_workload_redis(redis_url: str):
    store = RedisKVStore(redis_url, model="random", worker_id="w0")
    try:
        run_random_workload(seed=99, policy="fcfs", num_requests=150, store=store)
    finally:
        store.close()
