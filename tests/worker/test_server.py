"""The worker service over real gRPC on loopback: dialing, health, leaving, redialing.

Workers run a tiny random-weight Llama in-process; the scheduler is the real
scheduler service on a free port.
"""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
from grpc_health.v1 import health_pb2

from services.common.convert import (
    drain_message,
    leave_message,
    leave_refused_message,
    registration_message,
    scheduler_message_from_proto,
    step_message,
    worker_message_from_proto,
)
from services.common.limits import SchedulingLimits
from services.common.redis_server import free_port
from services.common.registration import Drain, LeaveRefused, LeaveRequest, WorkerRegistration
from services.common.scheduler_output import SchedulerOutput
from services.scheduler.server import SchedulerServer
from tests.grpc_utils import (
    NUM_KV_BLOCKS,
    FrontendClient,
    get_stats,
    greedy_request,
    health_status,
    reference_tokens,
    save_tiny_llama,
    start_scheduler,
    start_worker,
    wait_for_workers,
    wait_until,
)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
PREFIX = [random.Random(7).randrange(1, 256) for _ in range(64)]  # 4 full blocks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


async def generate(server: SchedulerServer, request) -> tuple[list[int], int]:
    """(tokens, num_cached_tokens) of one request through a fresh FrontendStream."""
    client = FrontendClient(server.address)
    await client.add(request)
    await client.wait_finished(request.request_id)
    await client.close()
    return client.tokens[request.request_id], client.finished[request.request_id].num_cached_tokens


def test_registration_and_scheduler_messages_round_trip():
    registration = WorkerRegistration("w0", "m", "float32", 16, 64, 256, 256, [2, 3],
                                      SchedulingLimits(max_num_seqs=8, max_num_batched_tokens=512))
    assert worker_message_from_proto(registration_message(registration)) == registration
    assert scheduler_message_from_proto(drain_message()) == Drain(leave_granted=False)
    assert scheduler_message_from_proto(drain_message(leave_granted=True)) == Drain(True)
    assert worker_message_from_proto(leave_message()) == LeaveRequest()
    assert scheduler_message_from_proto(leave_refused_message("why")) == LeaveRefused("why")
    step = SchedulerOutput(finished_req_ids={"a"}, step_id=9)
    assert scheduler_message_from_proto(step_message(step)) == step


def test_worker_waits_for_the_scheduler_then_registers_and_serves(model_dir):
    request = greedy_request("r", PREFIX[:20], 12)
    expected = reference_tokens(model_dir, [request])[request.request_id]

    async def scenario():
        port = free_port()
        worker = start_worker(f"127.0.0.1:{port}", model_dir, "w0", health_port=0)
        await wait_until(lambda: worker.service.kv_cache_id != "")  # loaded, now dialing
        health_address = f"127.0.0.1:{worker.service.health_port}"
        await asyncio.sleep(0.3)
        before = await health_status(health_address)
        # Loaded: alive (liveness), though it cannot serve without a scheduler.
        alive = await health_status(health_address, "liveness")
        server = await start_scheduler(port=port)
        await wait_for_workers(server.address, ["w0"])
        after = await health_status(health_address)
        stats = (await get_stats(server.address)).workers[0]
        tokens, _ = await generate(server, request)
        await server.stop(1.0)
        await asyncio.wait_for(worker.task, 5)  # drained: run() returns
        return before, alive, after, stats, tokens

    before, alive, after, stats, tokens = run(scenario())
    assert (before, alive, after) == (NOT_SERVING, SERVING, SERVING)
    assert (stats.worker_id, stats.num_total_blocks, stats.num_free_blocks) == (
        "w0", NUM_KV_BLOCKS - 1, NUM_KV_BLOCKS - 1)
    assert tokens == expected


def test_stop_while_dialing_returns_cleanly(model_dir):
    async def scenario():
        worker = start_worker(f"127.0.0.1:{free_port()}", model_dir, "w0")  # nobody listens
        await wait_until(lambda: worker.service.kv_cache_id != "")
        await asyncio.sleep(0.1)
        await worker.stop(timeout_s=2)
        return worker.service.engine_index

    assert run(scenario()) is None  # never registered


def test_stop_leaves_after_the_step_in_flight(model_dir):
    async def scenario():
        server = await start_scheduler()
        worker = start_worker(server.address, model_dir, "w0")
        await wait_for_workers(server.address, ["w0"])
        client = FrontendClient(server.address)
        await client.add(greedy_request("r", PREFIX[:10], 200))
        await wait_until(lambda: len(client.tokens["r"]) >= 2)
        await worker.stop()  # the SIGTERM path; returns without an error
        await client.wait_finished("r")
        stats = await get_stats(server.address)
        await client.close()
        await server.stop(0.1)
        return client.finished["r"], stats

    output, stats = run(scenario())
    # It was the only worker, so its request could not move anywhere.
    assert output.status_code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert list(stats.workers) == []


def test_scheduler_restart_keeps_the_worker_and_its_prefix_cache(model_dir, redis_url):
    first = greedy_request("first", PREFIX + [1, 2, 3], 4)
    shared = greedy_request("shared", PREFIX + [4, 5], 10)
    expected = reference_tokens(model_dir, [shared])["shared"]

    async def scenario():
        port = free_port()
        server = await start_scheduler(port=port, redis_url=redis_url)
        worker = start_worker(server.address, model_dir, "w0")
        await wait_for_workers(server.address, ["w0"])
        await generate(server, first)
        await server.stop(0.5, drain_workers=False)  # the worker stays and redials
        server = await start_scheduler(port=port, redis_url=redis_url)
        await wait_for_workers(server.address, ["w0"])
        result = await generate(server, shared)
        await server.stop(1.0)
        await asyncio.wait_for(worker.task, 5)
        return result

    tokens, num_cached_tokens = run(scenario())
    # The new scheduler rebuilt w0's prefix index from Redis, and w0 still
    # holds those blocks: the hit is real KV, the output unchanged.
    assert num_cached_tokens == 64
    assert tokens == expected


@pytest.mark.parametrize("use_redis", [False, True], ids=["in_memory", "redis"])
def test_restarted_worker_with_the_same_id_gets_no_stale_prefix_hits(model_dir, request, use_redis):
    redis_url = request.getfixturevalue("redis_url") if use_redis else None
    first = greedy_request("first", PREFIX + [1, 2, 3], 4)
    shared = greedy_request("shared", PREFIX + [4, 5], 10)
    expected = reference_tokens(model_dir, [shared])["shared"]

    async def scenario():
        server = await start_scheduler(redis_url=redis_url)
        old = start_worker(server.address, model_dir, "w0")
        await wait_for_workers(server.address, ["w0"])
        await generate(server, first)
        await old.stop()
        await wait_for_workers(server.address, [])
        # Same id, new process: its KV cache is empty whatever the store says.
        new = start_worker(server.address, model_dir, "w0")
        await wait_for_workers(server.address, ["w0"])
        result = await generate(server, shared)
        await server.stop(1.0)
        await asyncio.wait_for(new.task, 5)
        return result

    tokens, num_cached_tokens = run(scenario())
    assert num_cached_tokens == 0
    assert tokens == expected


def test_worker_serving_another_model_is_refused(model_dir):
    async def scenario():
        server = await start_scheduler(model="another-model")
        worker = start_worker(server.address, model_dir, "w0")
        try:
            await asyncio.wait_for(worker.task, 10)
        finally:
            await server.stop(0.1)

    with pytest.raises(grpc.aio.AioRpcError) as excinfo:
        run(scenario())
    assert excinfo.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "this scheduler serves 'another-model'" in excinfo.value.details()
