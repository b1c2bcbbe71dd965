"""A scheduler restarted against the same Redis keeps its prefix-cache hits."""

from __future__ import annotations

from services.common.engine import EngineCoreRequest
from services.common.model_runner_output import ModelRunnerOutput
from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import SchedulerOutput
from services.scheduler.config import SchedulerConfig
from services.scheduler.invariants import check_invariants
from services.scheduler.kv_store import RedisKVStore
from services.scheduler.scheduler import Scheduler

SHARED_PREFIX = list(range(500, 540))  # 40 tokens: 2 full blocks + 8


def step(scheduler: Scheduler) -> SchedulerOutput:
    scheduler_output = scheduler.schedule()
    req_ids = list(scheduler_output.num_scheduled_tokens)
    scheduler.update_from_output(
        scheduler_output, ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[7]] * len(req_ids)))
    check_invariants(scheduler)
    return scheduler_output


def make_scheduler(redis_url: str, num_blocks: int = 11) -> Scheduler:
    store = RedisKVStore(redis_url, model="smollm2", worker_id="w0")
    return Scheduler(SchedulerConfig(num_blocks=num_blocks), store)


def test_restart_keeps_prefix_hits(redis_url: str):
    first = make_scheduler(redis_url)
    first.add_request(EngineCoreRequest("a", SHARED_PREFIX + [1, 2], SamplingParams(max_tokens=2)))
    out = step(first)
    assert out.scheduled_new_reqs[0].block_ids == [1, 2, 3]
    while first.has_requests():
        step(first)
    assert first.kv_cache_manager.num_cached_blocks == 2
    first.kv_cache_manager.store.close()

    # A new process: nothing in memory, the prefix index comes back from Redis.
    second = make_scheduler(redis_url)
    check_invariants(second)
    assert second.kv_cache_manager.num_cached_blocks == 2
    second.add_request(EngineCoreRequest("b", SHARED_PREFIX + [3, 4, 5], SamplingParams(max_tokens=1)))
    out = step(second)
    new = out.scheduled_new_reqs[0]
    assert (new.block_ids[:2], new.num_computed_tokens) == ([1, 2], 32)
    assert out.num_scheduled_tokens == {"b": 11}
    stats = second.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (43, 32)
    second.kv_cache_manager.store.close()


def test_restart_with_another_pool_size_starts_clean(redis_url: str):
    first = make_scheduler(redis_url)
    first.add_request(EngineCoreRequest("a", SHARED_PREFIX, SamplingParams(max_tokens=1)))
    while first.has_requests():
        step(first)
    first.kv_cache_manager.store.close()

    second = make_scheduler(redis_url, num_blocks=21)
    assert second.kv_cache_manager.num_cached_blocks == 0
    second.add_request(EngineCoreRequest("b", SHARED_PREFIX, SamplingParams(max_tokens=1)))
    assert step(second).scheduled_new_reqs[0].num_computed_tokens == 0
    check_invariants(second)
    second.kv_cache_manager.store.close()


def test_restart_while_a_request_runs_frees_its_blocks_but_keeps_them_cached(redis_url: str):
    first = make_scheduler(redis_url)
    first.add_request(EngineCoreRequest("a", SHARED_PREFIX, SamplingParams(max_tokens=50)))
    step(first)
    step(first)
    assert first.kv_cache_manager.store.load().req_blocks == {"a": [1, 2, 3]}
    first.kv_cache_manager.store.close()  # the scheduler dies with "a" running

    second = make_scheduler(redis_url)
    check_invariants(second)  # includes: Redis == memory, so no request lists left
    assert second.kv_cache_manager.num_free_blocks == 10
    second.add_request(EngineCoreRequest("a-again", SHARED_PREFIX + [7], SamplingParams(max_tokens=1)))
    new = step(second).scheduled_new_reqs[0]
    assert (new.block_ids[:2], new.num_computed_tokens) == ([1, 2], 32)
    second.kv_cache_manager.store.close()
