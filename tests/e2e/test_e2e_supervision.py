"""The local cluster restarts whatever dies: scheduler, worker, frontend, Redis."""

from __future__ import annotations

import os
import signal
import time

import pytest

from kvmesh.client import Client
from tests.e2e.helpers import GREEDY, tiny_cluster_config, wait_for


@pytest.fixture(scope="module")
def cluster(make_cluster, tiny_model_dir, tmp_path_factory):
    return make_cluster(tiny_cluster_config(tiny_model_dir, tmp_path_factory.mktemp("logs")))


def answer(client: Client) -> list[int]:
    return list(client.complete("Hello there", max_tokens=6, **GREEDY).outputs[0].token_ids)


def kill_and_wait_for_restart(cluster, process) -> None:
    old_pid = process.pid
    os.kill(old_pid, signal.SIGKILL)
    wait_for(lambda: bool(cluster.supervise()) or process.pid != old_pid, timeout_s=30,
             what=f"{process.name} restarted")


@pytest.mark.parametrize("victim", ["scheduler", "worker", "frontend", "redis"])
def test_a_killed_service_is_restarted_and_serving_resumes(cluster, victim):
    with Client(cluster.address, timeout_s=60) as client:
        expected = answer(client)
    if victim == "redis":
        os.kill(cluster.redis.pid, signal.SIGKILL)
        wait_for(lambda: "redis" in cluster.supervise(), timeout_s=10, what="redis restarted")
    else:
        process = {"scheduler": cluster.scheduler, "worker": cluster.workers[0],
                   "frontend": cluster.frontends[0]}[victim]
        kill_and_wait_for_restart(cluster, process)
        process.wait_serving(deadline=_in(120))
    for frontend in cluster.frontends:
        frontend.wait_serving(deadline=_in(120))  # the frontend sees a worker again
    with Client(cluster.address, timeout_s=60) as client:
        assert answer(client) == expected


def _in(seconds: float) -> float:
    return time.monotonic() + seconds
