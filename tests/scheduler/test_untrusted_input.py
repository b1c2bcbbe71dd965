"""The scheduler behind the frontend: bad requests fail alone, aborts belong to their
owner, a request that loses two workers is not placed on a third, and a worker
that registers too big or lies in its output is refused or cut off.

Real scheduler service and in-process workers on loopback; the "frontends" are
raw FrontendStreams, which is what anyone reaching the scheduler's port has.
"""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest

from kvmesh.v1 import scheduler_pb2_grpc
from services.common.convert import (
    add_request_message,
    leave_message,
    registration_message,
    runner_output_message,
    scheduler_message_from_proto,
)
from services.common.engine import FinishReason
from services.common.model_runner_output import ModelRunnerOutput
from services.common.registration import LeaveRefused, WorkerRegistration
from tests.grpc_utils import (
    NUM_KV_BLOCKS,
    VOCAB_SIZE,
    FrontendClient,
    get_stats,
    greedy_request,
    reference_tokens,
    start_scheduler,
    start_worker,
    wait_for_workers,
    wait_until,
)

INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
INTERNAL = grpc.StatusCode.INTERNAL.value[0]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


def with_params(request, **changes):
    return dataclasses.replace(
        request, sampling_params=dataclasses.replace(request.sampling_params, **changes))


BAD_REQUESTS = {
    "out_of_vocab": (greedy_request("out_of_vocab", [5, VOCAB_SIZE + 7, 9], 4),
                     f"prompt must hold token ids in [0, {VOCAB_SIZE}), got {VOCAB_SIZE + 7}"),
    "negative_id": (greedy_request("negative_id", [5, -1], 4),
                    f"prompt must hold token ids in [0, {VOCAB_SIZE}), got -1"),
    "stop_id": (with_params(greedy_request("stop_id", [5, 6], 4), stop_token_ids=[10**6]),
                "stop_token_ids must hold token ids"),
    "n": (with_params(greedy_request("n", [5, 6], 4), n=3),
          "n must be 1 at the engine core"),
    "no_max_tokens": (with_params(greedy_request("no_max_tokens", [5, 6], 4), max_tokens=None),
                      "max_tokens must be set at the engine core"),
    "top_p": (with_params(greedy_request("top_p", [5, 6], 4), top_p=7.0),
              "top_p must be in (0, 1], got 7.0"),
    "logprobs": (with_params(greedy_request("logprobs", [5, 6], 4), logprobs=10_000),
                 "logprobs must be in [0, 20], got 10000"),
    "long_salt": (dataclasses.replace(greedy_request("long_salt", [5, 6], 4), cache_salt="s" * 300),
                  "cache_salt must be a string of 0 to 256 characters"),
}


def test_bad_requests_fail_alone_and_the_worker_serves_on(model_dir):
    good = greedy_request("good", [3, 4, 5, 6], 8)

    async def scenario():
        server = await start_scheduler()
        worker = start_worker(server.address, model_dir, "w0")
        await wait_for_workers(server.address, ["w0"])
        client = FrontendClient(server.address)
        await client.add(*(request for request, _ in BAD_REQUESTS.values()), good)
        await client.wait_finished("good", *BAD_REQUESTS)
        # A request whose fields cannot even be decoded fails alone too.
        malformed = add_request_message(greedy_request("bad_enum", [3, 4], 4))
        malformed.add_request.sampling_params.output_kind = 99
        await client.call.write(malformed)
        await client.add(greedy_request("after", [3, 4, 5, 6], 8))
        await client.wait_finished("bad_enum", "after")
        stats = await get_stats(server.address)
        await client.close()
        await server.stop(1.0)
        await worker.task
        return client, stats

    client, stats = run(scenario())
    for req_id, (_, message) in BAD_REQUESTS.items():
        output = client.finished[req_id]
        assert (output.finish_reason, output.status_code) == (FinishReason.ABORT, INVALID_ARGUMENT)
        assert message in output.finish_message, req_id
        assert client.tokens[req_id] == []
    assert client.finished["bad_enum"].status_code == INVALID_ARGUMENT
    assert len(client.tokens["good"]) == len(client.tokens["after"]) == 8
    assert client.tokens["good"] == client.tokens["after"]
    assert stats.workers[0].num_free_blocks == NUM_KV_BLOCKS - 1


def test_a_frontend_cannot_abort_another_frontends_request(model_dir):
    async def scenario():
        server = await start_scheduler()
        worker = start_worker(server.address, model_dir, "w0")
        await wait_for_workers(server.address, ["w0"])
        owner, intruder = FrontendClient(server.address), FrontendClient(server.address)
        await owner.add(greedy_request("victim", [3, 4, 5, 6], 40))
        await wait_until(lambda: len(owner.tokens["victim"]) >= 2)
        await intruder.abort("victim")
        await owner.abort("not-mine-either")
        await owner.wait_finished("victim")
        await owner.close()
        await intruder.close()
        await server.stop(1.0)
        await worker.task
        return owner

    owner = run(scenario())
    assert owner.finished["victim"].finish_reason == FinishReason.LENGTH
    assert len(owner.tokens["victim"]) == 40


def test_a_request_that_loses_two_workers_is_not_placed_on_a_third(model_dir):
    async def scenario():
        server = await start_scheduler()
        workers = {f"w{i}": start_worker(server.address, model_dir, f"w{i}") for i in range(3)}
        await wait_for_workers(server.address, list(workers))
        client = FrontendClient(server.address)
        await client.add(greedy_request("unlucky", [3, 4, 5, 6], 400))
        for _ in range(2):
            count = len(client.tokens["unlucky"])
            await wait_until(lambda: len(client.tokens["unlucky"]) >= count + 2)
            holder = next(s.worker_id for s in server.coordinator.sessions.values()
                          if "unlucky" in s.scheduler.requests)
            await workers.pop(holder).kill()
        await client.wait_finished("unlucky")
        await client.close()
        await server.stop(1.0)
        for worker in workers.values():
            await worker.task
        return client.finished["unlucky"]

    output = run(scenario())
    assert (output.finish_reason, output.status_code) == (FinishReason.ABORT, INTERNAL)
    assert "lost 2 workers" in output.finish_message


class LyingWorker:
    """A peer that registers like a worker, then answers its first step with a
    token id outside the vocabulary: what a compromised worker would send."""

    def __init__(self, address: str, model: str, **registration) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.call = scheduler_pb2_grpc.EngineCoreStub(self.channel).WorkerStream()
        self.registration = WorkerRegistration(
            **{"worker_id": "liar", "model": model, "dtype": "float32", "block_size": 16,
               "num_blocks": NUM_KV_BLOCKS, "max_model_len": 256, "vocab_size": VOCAB_SIZE,
               **registration})

    async def register(self) -> None:
        await self.call.write(registration_message(self.registration))
        await self.call.read()  # the acknowledgement

    async def lie_once(self) -> None:
        step = scheduler_message_from_proto(await self.call.read())
        req_ids = list(step.num_scheduled_tokens)
        await self.call.write(runner_output_message(ModelRunnerOutput(
            req_ids=req_ids, sampled_token_ids=[[VOCAB_SIZE + 1]] * len(req_ids),
            step_id=step.step_id)))

    async def close(self) -> None:
        self.call.cancel()
        await self.channel.close()


def test_a_cells_last_worker_asking_to_leave_is_refused_and_kept(model_dir):
    """However often it asks, a cell's only worker is not let go: it is told so,
    and requests are still placed on it."""
    request = greedy_request("r", [3, 4, 5, 6, 7], 1)

    async def scenario():
        server = await start_scheduler()
        peer = LyingWorker(server.address, str(model_dir))
        await peer.register()
        answers = []
        for _ in range(3):
            await peer.call.write(leave_message())
            answers.append(scheduler_message_from_proto(await peer.call.read()))
        client = FrontendClient(server.address)
        await client.add(request)
        step = scheduler_message_from_proto(await peer.call.read())  # placed on it all the same
        await client.close()
        await peer.close()
        await server.stop(0.1)
        return answers, step

    answers, step = run(scenario())
    assert answers == [LeaveRefused("it is the cell's last serving worker")] * 3
    assert list(step.num_scheduled_tokens) == ["r"]


def test_an_oversized_registration_is_refused(model_dir):
    async def scenario():
        server = await start_scheduler()
        liar = LyingWorker(server.address, str(model_dir), num_blocks=3_000_000)
        with pytest.raises(grpc.aio.AioRpcError) as excinfo:
            await liar.register()
        await liar.close()
        await server.stop(0.1)
        return excinfo.value

    error = run(scenario())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "num_blocks is 3000000, allowed range is [2, 1048576]" in error.details()


@pytest.mark.parametrize("misbehaviour", ["lies", "freezes"])
def test_a_lying_or_frozen_worker_is_cut_off_and_its_requests_finish_elsewhere(
        model_dir, misbehaviour):
    request = greedy_request("r", [3, 4, 5, 6, 7], 12)
    expected = reference_tokens(model_dir, [request])

    async def scenario():
        server = await start_scheduler(worker_step_timeout_s=1.0)
        bad = LyingWorker(server.address, str(model_dir), worker_id="bad")
        await bad.register()  # engine index 0: placement prefers it
        honest = start_worker(server.address, model_dir, "honest")
        await wait_for_workers(server.address, ["bad", "honest"])
        client = FrontendClient(server.address)
        await client.add(request)
        if misbehaviour == "lies":
            await bad.lie_once()  # else it never answers: the step timeout cuts it off
        await client.wait_finished("r")
        stats = await get_stats(server.address)
        await client.close()
        await bad.close()
        await server.stop(1.0)
        await honest.task
        return client, stats

    client, stats = run(scenario())
    assert dict(client.tokens) == expected
    assert [w.worker_id for w in stats.workers] == ["honest"]
