"""The Redis mirror off the step's path: serving goes on while Redis is stopped or
gone, and the mirror is whole again once Redis answers."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from services.common.engine import EngineCoreRequest
from services.common.model_runner_output import ModelRunnerOutput
from services.common.redis_server import EmbeddedRedis
from services.common.sampling_params import SamplingParams
from services.scheduler.config import SchedulerConfig
from services.scheduler.kv_mirror import MirroredKVStore, merge_deltas
from services.scheduler.kv_store import KVStateDelta, RedisKVStore
from services.scheduler.scheduler import Scheduler
from services.scheduler.worker_stores import REDIS_TIMEOUT_S, WorkerStores


@pytest.fixture
def redis_server():
    server = EmbeddedRedis()
    yield server
    server.stop()


def mirrored_scheduler(url: str, kv_cache_id: str = "cache-1") -> Scheduler:
    store = WorkerStores(url).open("m", "w0", kv_cache_id)
    assert isinstance(store, MirroredKVStore)
    return Scheduler(SchedulerConfig(num_blocks=40), store)


def run_steps(scheduler: Scheduler, rng: random.Random, num_steps: int) -> float:
    """Steps a random workload; returns the slowest step's seconds."""
    slowest = 0.0
    for i in range(num_steps):
        if len(scheduler.requests) < 6:
            prompt = [rng.randrange(8) for _ in range(rng.randrange(20, 60))]
            scheduler.add_request(EngineCoreRequest(
                f"r{rng.random()}", prompt, SamplingParams(max_tokens=rng.randrange(4, 20))))
        start = time.perf_counter()
        output = scheduler.schedule()
        req_ids = [r for r in output.num_scheduled_tokens
                   if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens]
        scheduler.update_from_output(output, ModelRunnerOutput(
            req_ids=req_ids, sampled_token_ids=[[rng.randrange(8)] for _ in req_ids],
            step_id=output.step_id))
        slowest = max(slowest, time.perf_counter() - start)
    return slowest


def stored(url: str):
    return RedisKVStore(url, "m", "w0").load()


def test_the_mirror_equals_memory_once_flushed(redis_server):
    scheduler = mirrored_scheduler(redis_server.url)
    run_steps(scheduler, random.Random(0), 60)
    store = scheduler.kv_cache_manager.store
    assert store.flush()
    assert stored(redis_server.url) == scheduler.kv_cache_manager.snapshot()
    assert store.durable_step_id == 60
    store.close()


def test_a_stopped_redis_never_stalls_a_step_and_the_mirror_catches_up(redis_server):
    scheduler = mirrored_scheduler(redis_server.url)
    store = scheduler.kv_cache_manager.store
    rng = random.Random(1)
    run_steps(scheduler, rng, 10)
    os.kill(redis_server.pid, signal.SIGSTOP)
    try:
        slowest = run_steps(scheduler, rng, 40)
        deadline = time.monotonic() + 5 * REDIS_TIMEOUT_S
        while not store.is_behind and time.monotonic() < deadline:
            run_steps(scheduler, rng, 1)
            time.sleep(0.05)
        assert store.is_behind
    finally:
        os.kill(redis_server.pid, signal.SIGCONT)
    # A write blocked on the stopped Redis would have taken a whole timeout.
    assert slowest < REDIS_TIMEOUT_S / 2
    run_steps(scheduler, rng, 3)
    assert store.flush()
    assert not store.is_behind and store.num_write_errors >= 1
    assert store.mirror_lag_s(time.monotonic()) == 0.0
    assert stored(redis_server.url) == scheduler.kv_cache_manager.snapshot()
    store.close()


def test_a_redis_restarted_empty_gets_the_whole_state_again(redis_server):
    scheduler = mirrored_scheduler(redis_server.url)
    store = scheduler.kv_cache_manager.store
    rng = random.Random(2)
    run_steps(scheduler, rng, 20)
    assert store.flush()
    port = redis_server.port
    redis_server.stop()
    run_steps(scheduler, rng, 20)  # serving goes on without Redis
    with EmbeddedRedis(port=port) as restarted:
        run_steps(scheduler, rng, 5)
        deadline = time.monotonic() + 10
        while not (store.flush(0.2) and stored(restarted.url) is not None):
            assert time.monotonic() < deadline, "the mirror never caught up"
            scheduler.commit_store()  # what an idle session does
        assert stored(restarted.url) == scheduler.kv_cache_manager.snapshot()
        assert RedisKVStore(restarted.url, "m", "w0").read_kv_cache_id() == "cache-1"
        store.close()


def test_a_worker_registers_while_redis_is_down_and_its_mirror_follows(redis_server):
    port = redis_server.port
    redis_server.stop()
    scheduler = mirrored_scheduler(f"redis://127.0.0.1:{port}/0")
    store = scheduler.kv_cache_manager.store
    assert store.is_behind and store.wants_full_state() is False  # the recovery commit was whole
    rng = random.Random(3)
    run_steps(scheduler, rng, 10)
    with EmbeddedRedis(port=port) as restarted:
        assert store.flush(10)
        assert stored(restarted.url) == scheduler.kv_cache_manager.snapshot()
        store.close()


def test_merged_deltas_apply_like_the_sequence():
    a = KVStateDelta(10, 16, 5, step_id=1, prefix_index={"h1": [1], "h2": [2]}, req_blocks={"r": [1]})
    b = KVStateDelta(10, 16, 7, step_id=2, prefix_index={"h2": None}, req_blocks={"r": None})
    merged = merge_deltas(a, b)
    assert (merged.num_free_blocks, merged.step_id) == (7, 2)
    assert merged.prefix_index == {"h1": [1], "h2": None} and merged.req_blocks == {"r": None}
    clear = KVStateDelta(10, 16, 9, clear=True, step_id=3)
    assert merge_deltas(merged, clear) is clear
    assert merge_deltas(clear, a).clear  # a clear stays first, later changes on top
