"""Failures of real processes: a worker SIGKILLed mid-generation, a frontend killed,
the last worker gone. Clients must see either an uninterrupted, unchanged
stream or a clean UNAVAILABLE, never a hang.
"""

from __future__ import annotations

import signal

import grpc
import pytest

from kvmesh.client import Client
from kvmesh.cluster import LocalCluster, ServiceProcess
from tests.e2e.helpers import (
    SCHEDULING_MODES,
    Streams,
    all_blocks_free,
    prompts,
    reference,
    sigkill_a_busy_worker,
    tiny_cluster_config,
    wait_for,
)


@pytest.fixture(scope="module", params=list(SCHEDULING_MODES))
def cluster(make_cluster, tiny_model_dir, tmp_path_factory, request) -> LocalCluster:
    config = tiny_cluster_config(tiny_model_dir, tmp_path_factory.mktemp("logs"),
                                 num_workers=2, num_frontends=2)
    config.scheduler_args += SCHEDULING_MODES[request.param]
    return make_cluster(config)


def kill(process: ServiceProcess) -> None:
    process.signal(signal.SIGKILL)
    process.popen.wait(10)


def test_sigkill_a_worker_mid_generation_keeps_every_greedy_output(cluster):
    client = Client(cluster.frontend_addresses[0], timeout_s=60)
    token_prompts = prompts(0, 6)
    expected = reference(client, token_prompts)

    streams = Streams(client, token_prompts)
    assert streams.started.wait(30)
    victim = sigkill_a_busy_worker(cluster, client)
    streams.join()

    assert streams.errors == [None] * 6
    assert streams.tokens == expected
    assert [w.worker_id for w in client.stats().workers] == [
        w.name for w in cluster.workers if w is not victim]
    wait_for(lambda: all_blocks_free(client), what="blocks freed")
    client.close()


def test_killing_one_frontend_leaves_the_other_undisturbed(cluster):
    survivor = Client(cluster.frontend_addresses[1], timeout_s=60)
    doomed = Client(cluster.frontend_addresses[0], timeout_s=60)
    token_prompts = prompts(1, 2)
    expected = reference(survivor, token_prompts)

    # 2 + 2 requests: all run at once on the remaining worker (max_num_seqs 4).
    kept = Streams(survivor, token_prompts)
    lost = Streams(doomed, prompts(2, 2))
    assert kept.started.wait(30) and lost.started.wait(30)
    kill(cluster.frontends[0])
    kept.join()
    lost.join()

    assert kept.errors == [None] * 2 and kept.tokens == expected
    assert lost.errors == [grpc.StatusCode.UNAVAILABLE] * 2
    # The scheduler aborted the dead frontend's requests: every block is free.
    wait_for(lambda: all_blocks_free(survivor), what="blocks freed")
    survivor.close()
    doomed.close()


def test_losing_the_last_worker_is_unavailable(cluster):
    client = Client(cluster.frontend_addresses[-1], timeout_s=60)
    streams = Streams(client, prompts(3, 1))
    assert streams.started.wait(30)
    for worker in cluster.workers:
        kill(worker)
    streams.join()
    assert streams.errors == [grpc.StatusCode.UNAVAILABLE]

    wait_for(lambda: not client.stats().workers, what="no worker registered")
    with pytest.raises(grpc.RpcError) as info:
        list(client.generate("hi", max_tokens=4))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no worker is registered" in info.value.details()
    client.close()
