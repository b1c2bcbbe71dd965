"""The scheduler service serves through a Redis outage: no request fails, no step
waits, and the mirror is whole again when Redis returns (real processes on loopback)."""

from __future__ import annotations

import asyncio
import os
import random
import signal

import pytest

from services.common.engine import FinishReason
from services.common.redis_server import EmbeddedRedis
from services.scheduler.kv_store import RedisKVStore
from tests.grpc_utils import (
    NUM_KV_BLOCKS,
    FrontendClient,
    get_stats,
    greedy_request,
    reference_tokens,
    start_scheduler,
    start_worker,
    wait_for_workers,
    wait_until,
)


@pytest.fixture
def redis_server():
    server = EmbeddedRedis()
    yield server
    server.stop()


def requests_for(tag: str, num: int):
    rng = random.Random(tag)
    return [greedy_request(f"{tag}{i}", [rng.randrange(1, 256) for _ in range(24 + i)], 60)
            for i in range(num)]


def mirror_matches_memory(server, redis_url: str) -> bool:
    for session in server.coordinator.sessions.values():
        kv = session.scheduler.kv_cache_manager
        model = server.coordinator.model
        if RedisKVStore(redis_url, model, session.worker_id).load() != kv.snapshot():
            return False
    return True


async def stream_all(server, requests) -> FrontendClient:
    client = FrontendClient(server.address)
    await client.add(*requests)
    return client


def test_killing_redis_mid_generation_loses_nothing(model_dir, redis_server):
    first, second = requests_for("a", 4), requests_for("b", 4)
    expected = reference_tokens(model_dir, first + second)
    port = redis_server.port

    async def scenario():
        server = await start_scheduler(redis_url=redis_server.url)
        workers = [start_worker(server.address, model_dir, f"w{i}") for i in range(2)]
        await wait_for_workers(server.address, ["w0", "w1"])
        client = await stream_all(server, first)
        await wait_until(lambda: all(len(client.tokens[r.request_id]) >= 5 for r in first))
        redis_server.stop()  # mid-generation
        await client.add(*second)  # new work is placed and served without Redis
        await client.wait_finished(*expected)
        stats = await get_stats(server.address)
        with EmbeddedRedis(port=port) as restarted:  # back, and empty
            await wait_until(lambda: mirror_matches_memory(server, restarted.url), 15)
        await client.close()
        await server.stop(1.0)
        for worker in workers:
            await worker.task
        return client, stats

    client, stats = asyncio.run(asyncio.wait_for(scenario(), 90))
    assert dict(client.tokens) == expected
    assert {o.finish_reason for o in client.finished.values()} == {FinishReason.LENGTH}
    assert len(stats.workers) == 2
    assert all(w.num_free_blocks == NUM_KV_BLOCKS - 1 for w in stats.workers)


def test_a_stopped_redis_stalls_no_request(model_dir, redis_server):
    requests = requests_for("s", 3)
    expected = reference_tokens(model_dir, requests)

    async def scenario():
        server = await start_scheduler(redis_url=redis_server.url)
        worker = start_worker(server.address, model_dir, "w0")
        await wait_for_workers(server.address, ["w0"])
        os.kill(redis_server.pid, signal.SIGSTOP)
        try:
            # 180 steps each waiting a Redis timeout would outlast the scenario's limit.
            client = await stream_all(server, requests)
            await client.wait_finished(*expected, timeout_s=30)
        finally:
            os.kill(redis_server.pid, signal.SIGCONT)
        await wait_until(lambda: mirror_matches_memory(server, redis_server.url), 15)
        await client.close()
        await server.stop(1.0)
        await worker.task
        return client

    client = asyncio.run(asyncio.wait_for(scenario(), 90))
    assert dict(client.tokens) == expected
