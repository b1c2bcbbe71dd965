"""The scheduler service over real gRPC on loopback, with real workers (tiny random Llama).

Each test runs its own scheduler and workers in-process on free ports and
talks to the scheduler through a raw FrontendStream, like a frontend does.
"""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
from grpc_health.v1 import health_pb2

from kvmesh.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common.engine import FinishReason
from services.common.limits import SchedulingLimits
from services.common.registration import WorkerRegistration
from services.scheduler.config import SchedulingOptions, make_scheduler_config
from tests.grpc_utils import (
    LIMITS,
    NUM_KV_BLOCKS,
    FrontendClient,
    get_stats,
    greedy_request,
    health_status,
    reference_tokens,
    reflection_services,
    start_scheduler,
    start_worker,
    wait_for_workers,
    wait_until,
)

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def random_prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 256) for _ in range(length)]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_greedy_tokens_equal_in_process_engine(model_dir, async_scheduling):
    requests = [greedy_request(f"r{i}", random_prompt(i, n), 16) for i, n in enumerate((5, 17, 40, 3))]
    expected = reference_tokens(model_dir, requests)

    async def scenario():
        server = await start_scheduler(SchedulingOptions(limits=LIMITS,
                                                         async_scheduling=async_scheduling))
        worker = start_worker(server.address, model_dir, "w0")
        await wait_for_workers(server.address, ["w0"])
        client = FrontendClient(server.address)
        in_flight = []

        async def watch() -> None:  # how many steps the session has out, as it runs
            while True:
                in_flight.extend(len(s.in_flight) for s in server.coordinator.sessions.values())
                await asyncio.sleep(0.001)

        watcher = asyncio.create_task(watch())
        await client.add(*requests)
        await client.wait_finished(*expected)
        watcher.cancel()
        await client.close()
        await server.stop(1.0)
        await worker.task
        return client, max(in_flight)

    client, max_in_flight = run(scenario())
    assert max_in_flight == (2 if async_scheduling else 1)
    assert dict(client.tokens) == expected
    assert {r: out.finish_reason for r, out in client.finished.items()} == dict.fromkeys(
        expected, FinishReason.LENGTH)
    assert {r: set(ids) for r, ids in client.engine_indexes.items()} == dict.fromkeys(expected, {0})


def test_health_serving_and_reflection_lists_engine_core():
    async def scenario():
        server = await start_scheduler()
        statuses = [await health_status(server.address, s)
                    for s in ("", "kvmesh.v1.EngineCore", "liveness")]
        services = await reflection_services(server.address)
        await server.stop(0.1)
        return statuses, services

    statuses, services = run(scenario())
    assert statuses == [SERVING, SERVING, SERVING]
    assert services == ["grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                        "kvmesh.v1.EngineCore"]


def test_two_workers_both_receive_work(model_dir):
    requests = [greedy_request(f"r{i}", random_prompt(10 + i, 20), 12) for i in range(4)]
    expected = reference_tokens(model_dir, requests)

    async def scenario():
        server = await start_scheduler()
        workers = [start_worker(server.address, model_dir, f"w{i}") for i in range(2)]
        await wait_for_workers(server.address, ["w0", "w1"])
        client = FrontendClient(server.address)
        await client.add(*requests)
        await client.wait_finished(*expected)
        stats = await get_stats(server.address)
        await client.close()
        await server.stop(1.0)
        await asyncio.gather(*(w.task for w in workers))
        return client, stats

    client, stats = run(scenario())
    assert dict(client.tokens) == expected
    # No prefix hits anywhere: each goes to the less loaded, ties to engine 0.
    assert {r: set(ids) for r, ids in client.engine_indexes.items()} == {
        "r0": {0}, "r1": {1}, "r2": {0}, "r3": {1}}
    assert sorted((w.worker_id, w.prefix_cache_queries) for w in stats.workers) == [
        ("w0", 40), ("w1", 40)]


def test_request_sharing_a_prefix_goes_to_the_worker_holding_it(model_dir):
    prefix = random_prompt(100, 64)  # 4 full blocks
    first = greedy_request("first", prefix + [7, 8, 9], 4)
    busy = greedy_request("busy", random_prompt(101, 10), 60)
    shared = greedy_request("shared", prefix + [11, 12], 8)
    other = greedy_request("other", random_prompt(102, 10), 8)
    expected = reference_tokens(model_dir, [shared, other])

    async def scenario():
        server = await start_scheduler(load_weight_tokens=32)
        workers = [start_worker(server.address, model_dir, f"w{i}") for i in range(2)]
        await wait_for_workers(server.address, ["w0", "w1"])
        client = FrontendClient(server.address)
        await client.add(first)
        await client.wait_finished("first")
        # w0 now caches the prefix. "busy" goes to w0 too (tie, lower index);
        # "shared" still prefers w0: 64 hit tokens - 32 * 1 request > 0 - 0;
        # "other" has no hit anywhere and goes to the idle w1.
        await client.add(busy, shared, other)
        await client.wait_finished("busy", "shared", "other")
        await client.close()
        await server.stop(1.0)
        await asyncio.gather(*(w.task for w in workers))
        return client

    client = run(scenario())
    placed = {r: set(ids) for r, ids in client.engine_indexes.items()}
    assert placed == {"first": {0}, "busy": {0}, "shared": {0}, "other": {1}}
    assert client.finished["shared"].num_cached_tokens == 64
    assert client.finished["other"].num_cached_tokens == 0
    assert {r: client.tokens[r] for r in expected} == expected


def test_abort_frees_blocks_and_the_worker_drops_the_request(model_dir):
    async def scenario():
        server = await start_scheduler()
        worker = start_worker(server.address, model_dir, "w0")
        await wait_for_workers(server.address, ["w0"])
        client = FrontendClient(server.address)
        await client.add(greedy_request("long", random_prompt(3, 40), 200))
        await wait_until(lambda: len(client.tokens["long"]) >= 3)
        await client.abort("long")
        runner = worker.service.worker.model_runner
        await wait_until(lambda: not runner.requests)  # got it in finished_req_ids
        stats = (await get_stats(server.address)).workers[0]
        await client.close()
        await server.stop(1.0)
        await worker.task
        return client, stats

    client, stats = run(scenario())
    assert "long" not in client.finished  # an abort needs no answer
    assert len(client.tokens["long"]) < 200
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (0, 0)
    assert stats.num_total_blocks == NUM_KV_BLOCKS - 1  # the null block is not counted
    assert stats.num_free_blocks == stats.num_total_blocks


def test_frontend_disconnect_aborts_its_requests(model_dir):
    async def scenario():
        server = await start_scheduler()
        worker = start_worker(server.address, model_dir, "w0")
        await wait_for_workers(server.address, ["w0"])
        leaving, staying = FrontendClient(server.address), FrontendClient(server.address)
        await leaving.add(greedy_request("gone", random_prompt(4, 30), 200))
        await staying.add(greedy_request("kept", random_prompt(5, 30), 40))
        await wait_until(lambda: len(leaving.tokens["gone"]) >= 2)
        await leaving.close()
        await staying.wait_finished("kept")
        await wait_until(lambda: not worker.service.worker.model_runner.requests)
        stats = (await get_stats(server.address)).workers[0]
        await staying.close()
        await server.stop(1.0)
        await worker.task
        return staying, stats

    staying, stats = run(scenario())
    assert len(staying.tokens["kept"]) == 40
    assert (stats.num_running_reqs, stats.num_free_blocks) == (0, NUM_KV_BLOCKS - 1)


def test_cut_worker_stream_moves_requests_to_the_other_worker(model_dir):
    requests = [greedy_request(f"r{i}", random_prompt(20 + i, 25 + 7 * i), 150) for i in range(4)]
    expected = reference_tokens(model_dir, requests)

    async def scenario():
        server = await start_scheduler()
        workers = [start_worker(server.address, model_dir, f"w{i}") for i in range(2)]
        await wait_for_workers(server.address, ["w0", "w1"])
        client = FrontendClient(server.address)
        await client.add(*requests)
        # The kill comes once engine 0's requests (r0, r2) are a few tokens in, not
        # once every request is: on a busy machine engine 1 may be slow to start
        # (a first compilation), and engine 0's could finish in the meantime.
        await wait_until(lambda: all(len(client.tokens[r]) >= 5 for r in ("r0", "r2")))
        first, second = sorted(workers, key=lambda w: w.service.engine_index)
        await first.kill()  # mid-generation, a step in flight
        await client.wait_finished(*expected)
        stats = await get_stats(server.address)
        await client.close()
        await server.stop(1.0)
        await second.task
        return client, stats, second.service.config.worker_id

    client, stats, survivor = run(scenario())
    # No token lost or repeated: the same greedy continuation as uninterrupted.
    assert dict(client.tokens) == expected
    assert {r: o.finish_reason for r, o in client.finished.items()} == dict.fromkeys(
        expected, FinishReason.LENGTH)
    for req_id in ("r0", "r2"):  # placed on engine 0, finished on engine 1
        indexes = client.engine_indexes[req_id]
        assert indexes[0] == 0 and indexes[-1] == 1
        assert indexes == sorted(indexes)
    assert set(client.engine_indexes["r1"]) == set(client.engine_indexes["r3"]) == {1}
    assert [w.worker_id for w in stats.workers] == [survivor]
    assert stats.workers[0].num_free_blocks == NUM_KV_BLOCKS - 1


def test_losing_the_last_worker_finishes_requests_unavailable(model_dir):
    async def scenario():
        server = await start_scheduler()
        worker = start_worker(server.address, model_dir, "w0")
        await wait_for_workers(server.address, ["w0"])
        client = FrontendClient(server.address)
        await client.add(greedy_request("r", random_prompt(6, 20), 200))
        await wait_until(lambda: len(client.tokens["r"]) >= 2)
        await worker.kill()
        await client.wait_finished("r")
        await client.close()
        await server.stop(0.1)
        return client.finished["r"]

    output = run(scenario())
    assert (output.finish_reason, output.status_code) == (FinishReason.ABORT, UNAVAILABLE)
    assert "w0 was lost" in output.finish_message


def test_no_worker_fails_fast_with_unavailable():
    async def scenario():
        server = await start_scheduler()
        client = FrontendClient(server.address)
        await client.add(greedy_request("r", [1, 2, 3], 4))
        await client.wait_finished("r", timeout_s=5)
        await client.close()
        await server.stop(0.1)
        return client

    client = run(scenario())
    output = client.finished["r"]
    assert (output.finish_reason, output.status_code) == (FinishReason.ABORT, UNAVAILABLE)
    assert output.finish_message == "no worker is registered"
    assert client.tokens["r"] == []


def test_empty_frontend_message_ends_the_stream_invalid_argument():
    async def scenario():
        server = await start_scheduler()
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                call = scheduler_pb2_grpc.EngineCoreStub(channel).FrontendStream()
                await call.write(scheduler_pb2.FrontendMessage())
                with pytest.raises(grpc.aio.AioRpcError) as excinfo:
                    await call.read()
                return excinfo.value
        finally:
            await server.stop(0.1)

    error = run(scenario())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "FrontendMessage has no kind set, must be add_request or abort"


def test_full_waiting_queue_is_resource_exhausted(model_dir):
    async def scenario():
        scheduling = SchedulingOptions(limits=SchedulingLimits(max_num_seqs=1), max_num_waiting=1)
        server = await start_scheduler(scheduling)
        worker = start_worker(server.address, model_dir, "w0")
        await wait_for_workers(server.address, ["w0"])
        client = FrontendClient(server.address)
        await client.add(greedy_request("running", random_prompt(7, 10), 60))
        await wait_until(lambda: len(client.tokens["running"]) >= 1)
        await client.add(greedy_request("waiting", random_prompt(8, 10), 5),
                         greedy_request("refused", random_prompt(9, 10), 5))
        await client.wait_finished("running", "waiting", "refused")
        await client.close()
        await server.stop(1.0)
        await worker.task
        return client

    client = run(scenario())
    refused = client.finished["refused"]
    assert (refused.finish_reason, refused.status_code) == (FinishReason.ABORT, RESOURCE_EXHAUSTED)
    assert "max_num_waiting is 1" in refused.finish_message
    assert [len(client.tokens[r]) for r in ("running", "waiting", "refused")] == [60, 5, 0]
    assert client.finished["waiting"].status_code == 0


def test_stop_drains_not_serving_refuses_new_work_and_releases_workers(model_dir):
    async def scenario():
        server = await start_scheduler()
        worker = start_worker(server.address, model_dir, "w0", worker={"max_model_len": 512})
        await wait_for_workers(server.address, ["w0"])
        client = FrontendClient(server.address)
        await client.add(greedy_request("long", random_prompt(10, 10), 480))
        await wait_until(lambda: len(client.tokens["long"]) >= 1)
        # "long" needs 480 steps; it cannot finish in the 0.5 s drain window.
        stopping = asyncio.create_task(server.stop(1.0))
        await wait_until(lambda: server.coordinator.draining)
        status = await health_status(server.address)
        await client.add(greedy_request("late", [1, 2, 3], 4))
        await client.wait_finished("long", "late")
        await stopping
        await asyncio.wait_for(worker.task, 5)  # the worker left on Drain
        await client.close()
        return client, status

    client, status = run(scenario())
    assert status == NOT_SERVING
    late, long = client.finished["late"], client.finished["long"]
    assert (late.status_code, late.finish_message) == (UNAVAILABLE, "the scheduler is shutting down")
    assert (long.finish_reason, long.status_code) == (FinishReason.ABORT, UNAVAILABLE)
    assert 1 <= len(client.tokens["long"]) < 480


def test_worker_limits_cap_the_schedulers_per_worker():
    options = SchedulingOptions(limits=SchedulingLimits(max_num_seqs=64,
                                                        max_num_batched_tokens=4096))
    small = WorkerRegistration("w", "m", "float32", 16, 100, 512, 256, [2],
                               SchedulingLimits(max_num_seqs=8, max_num_batched_tokens=512))
    capped = make_scheduler_config(options, small, engine_index=1)
    assert (capped.limits.max_num_seqs, capped.limits.max_num_batched_tokens) == (8, 512)
    assert (capped.num_blocks, capped.block_size, capped.max_model_len) == (100, 16, 512)
    # A worker that reports no limits (0) gets the scheduler's.
    unreported = WorkerRegistration("w", "m", "float32", 16, 100, 512, 256, [2])
    defaults = make_scheduler_config(options, unreported, engine_index=2)
    assert (defaults.limits.max_num_seqs, defaults.limits.max_num_batched_tokens) == (64, 4096)
