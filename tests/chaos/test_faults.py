"""Every single fault survived: 0 requests lost, 0 blocks leaked, the same tokens.

Each scenario runs the workload of conftest.py through the public API while
it injects one fault into the live cluster, then waits for the cluster to be
idle with every block free. Only a killed frontend makes its own clients
retry (their connection is gone); every other fault is absorbed by the
cluster, so no client retries at all.
"""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

from kvmesh.client import Client
from kvmesh.v1 import scheduler_pb2_grpc
from services.common.convert import (
    add_request_message,
    engine_core_output_from_proto,
    registration_message,
    runner_output_message,
    scheduler_message_from_proto,
)
from services.common.engine import EngineCoreRequest
from services.common.model_runner_output import ModelRunnerOutput
from services.common.registration import WorkerRegistration
from services.common.sampling_params import SamplingParams
from services.common.security import secret_metadata
from tests.chaos.conftest import run_workload, wait_idle

pytestmark = pytest.mark.slow

RECOVERY_S: dict[str, float] = {}


def pause(pid: int, seconds: float) -> None:
    os.kill(pid, signal.SIGSTOP)
    time.sleep(seconds)
    os.kill(pid, signal.SIGCONT)


FAULTS = {
    "kill_worker": lambda c: os.kill(c.workers[0].pid, signal.SIGKILL),
    "kill_scheduler": lambda c: os.kill(c.scheduler.pid, signal.SIGKILL),
    "kill_frontend": lambda c: os.kill(c.frontends[0].pid, signal.SIGKILL),
    "kill_redis": lambda c: os.kill(c.redis.pid, signal.SIGKILL),
    "stop_redis": lambda c: pause(c.redis.pid, 4.0),
    # Longer than the scheduler's 3 s step timeout: the worker is declared lost.
    "stop_worker": lambda c: pause(c.workers[1].pid, 5.0),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_single_fault_loses_nothing(cluster, supervisor, baseline, fault):
    started = time.monotonic()
    outcome = run_workload(cluster, lambda: FAULTS[fault](cluster))
    assert outcome.failures == {}
    assert outcome.tokens == baseline.tokens  # greedy and seeded, token for token
    if fault != "kill_frontend":
        assert outcome.num_retries == 0
    wait_idle(cluster)
    RECOVERY_S[fault] = time.monotonic() - started
    print(f"\nchaos: {fault}: {len(outcome.tokens)} requests, 0 lost, 0 blocks leaked, "
          f"{outcome.num_retries} client retries, workload + recovery {RECOVERY_S[fault]:.1f} s")


def test_poison_requests_and_peers_hurt_no_one_else(cluster, supervisor, baseline):
    """While the workload runs: a bad token id through the public API and through
    the scheduler's port, requests a worker's logits processor refuses, breaks
    on, or turns to NaN, a worker without the secret, and one that lies."""
    errors: dict[str, grpc.StatusCode] = {}

    def poison() -> None:
        with Client(cluster.address, timeout_s=30) as client:
            try:
                client.complete(token_ids=[5, 10**6], max_tokens=4)
            except grpc.RpcError as e:
                errors["public"] = e.code()
            for kind in ("refuse", "raise", "nan"):
                try:
                    client.complete("poisoned", max_tokens=4, extra_args={"poison": kind})
                except grpc.RpcError as e:
                    errors[kind] = e.code()
        errors["scheduler"] = _scheduler_port_poison(cluster)
        errors["no_secret_worker"] = _register(cluster, secret=None)
        errors["lying_worker"] = _register(cluster, secret=cluster.cluster_secret, lie=True)

    num_restarts = len(supervisor.restarted)
    outcome = run_workload(cluster, poison)
    assert outcome.failures == {} and outcome.num_retries == 0
    assert outcome.tokens == baseline.tokens
    assert len(supervisor.restarted) == num_restarts  # no process went down
    assert errors == {"public": grpc.StatusCode.INVALID_ARGUMENT,
                      "refuse": grpc.StatusCode.INVALID_ARGUMENT,
                      "raise": grpc.StatusCode.INTERNAL, "nan": grpc.StatusCode.INTERNAL,
                      "scheduler": grpc.StatusCode.INVALID_ARGUMENT,
                      "no_secret_worker": grpc.StatusCode.UNAUTHENTICATED,
                      "lying_worker": grpc.StatusCode.OK}
    wait_idle(cluster)


def test_a_flood_at_every_limit_leaves_the_workload_untouched(cluster, supervisor, baseline):
    codes: list[grpc.StatusCode] = []
    longest_text = "word " * 240  # just under the model's 256 tokens

    def flood() -> None:
        with Client(cluster.frontend_addresses[1], timeout_s=120) as client:
            for kwargs in ([dict(prompt="hi", n=128, max_tokens=2)] * 3
                           + [dict(prompt="hi", stop=["x" * 1024] * 64, max_tokens=8)] * 5
                           + [dict(prompt=longest_text, max_tokens=8)] * 5
                           + [dict(prompt="x" * 10_000_000, max_tokens=1)] * 2):
                try:
                    client.complete(**kwargs)
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as e:
                    codes.append(e.code())

    outcome = run_workload(cluster, flood)
    assert outcome.failures == {} and outcome.num_retries == 0
    assert outcome.tokens == baseline.tokens
    assert codes.count(grpc.StatusCode.INVALID_ARGUMENT) == 2  # the 10 MB prompts
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
                          grpc.StatusCode.RESOURCE_EXHAUSTED}
    wait_idle(cluster)


def _scheduler_port_poison(cluster) -> grpc.StatusCode:
    """An out-of-vocabulary request sent straight to the scheduler, with the secret."""
    with grpc.insecure_channel(cluster.scheduler_address) as channel:
        stub = scheduler_pb2_grpc.EngineCoreStub(channel)
        request = EngineCoreRequest("poison", [5, 10**7], SamplingParams(max_tokens=4))
        replies = stub.FrontendStream(iter([add_request_message(request)]), timeout=30,
                                      metadata=secret_metadata(cluster.cluster_secret))
        for message in replies:
            for proto in message.outputs:
                output = engine_core_output_from_proto(proto)
                if output.finished:
                    return grpc.StatusCode.INVALID_ARGUMENT if output.status_code == \
                        grpc.StatusCode.INVALID_ARGUMENT.value[0] else grpc.StatusCode.UNKNOWN
    return grpc.StatusCode.UNKNOWN


def _register(cluster, secret: str | None, lie: bool = False) -> grpc.StatusCode:
    """A peer registering as a worker; with ``lie`` it answers its first step with
    a token id outside the vocabulary (it is cut off, its requests re-placed)."""
    model = str(cluster.config.model)
    registration = WorkerRegistration("intruder", model, "float32", 16, 64, 256, 49152)
    with grpc.insecure_channel(cluster.scheduler_address) as channel:
        stub = scheduler_pb2_grpc.EngineCoreStub(channel)
        outbox: list = [registration_message(registration)]

        def messages():
            while True:
                while not outbox:
                    time.sleep(0.01)
                message = outbox.pop(0)
                if message is None:
                    return
                yield message

        try:
            replies = stub.WorkerStream(messages(), timeout=30,
                                        metadata=secret_metadata(secret))
            next(replies)  # the acknowledgement
            if lie:
                step = scheduler_message_from_proto(next(replies))
                req_ids = list(step.num_scheduled_tokens)
                outbox.append(runner_output_message(ModelRunnerOutput(
                    req_ids=req_ids, sampled_token_ids=[[10**7]] * len(req_ids),
                    step_id=step.step_id)))
                for _ in replies:  # the scheduler ends the stream
                    pass
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED or not lie:
                return e.code()
        finally:
            outbox.append(None)
    return grpc.StatusCode.OK
