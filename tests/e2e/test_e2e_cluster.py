"""A real cluster (Redis, scheduler, 2 workers, 2 frontends as processes) on a tiny model.

The tiny random Llama carries SmolLM2's tokenizer: what it says is
meaningless, so the assertions compare runs with each other.
"""

from __future__ import annotations

import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvmesh.client import Client
from kvmesh.healthcheck import check_health
from kvmesh.v1 import api_pb2, scheduler_pb2_grpc
from services.common.security import secret_metadata
from tests.e2e.helpers import (
    GREEDY,
    SCHEDULING_MODES,
    all_blocks_free,
    tiny_cluster_config,
    wait_for,
)

MAX_NUM_WAITING = 4


@pytest.fixture(scope="module", params=list(SCHEDULING_MODES))
def cluster(make_cluster, tiny_model_dir, tmp_path_factory, request):
    config = tiny_cluster_config(
        tiny_model_dir, tmp_path_factory.mktemp("logs"), num_workers=2, num_frontends=2,
        scheduler_args=["--max-num-seqs", "4", "--max-num-waiting", str(MAX_NUM_WAITING),
                        *SCHEDULING_MODES[request.param]],
    )
    return make_cluster(config)


@pytest.fixture(scope="module")
def clients(cluster):
    clients = [Client(address, timeout_s=60) for address in cluster.frontend_addresses]
    yield clients
    for client in clients:
        client.close()


def random_prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(length)]


def reflection_services(address: str) -> list[str]:
    with grpc.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (response,) = stub.ServerReflectionInfo(iter([request]), timeout=10)
    return sorted(s.name for s in response.list_services_response.service)


def test_every_frontend_is_serving_and_lists_generation(cluster):
    for address in cluster.frontend_addresses:
        assert check_health(address) == "SERVING"
        assert "kvmesh.v1.Generation" in reflection_services(address)
    assert check_health(cluster.scheduler_address) == "SERVING"
    assert all(check_health(w.health_address) == "SERVING" for w in cluster.workers)


def test_the_internal_plane_needs_the_clusters_own_secret(cluster):
    with grpc.insecure_channel(cluster.scheduler_address) as channel:
        get_stats = scheduler_pb2_grpc.EngineCoreStub(channel).GetStats
        with pytest.raises(grpc.RpcError) as excinfo:
            get_stats(api_pb2.GetStatsRequest(), timeout=10)
        assert excinfo.value.code() == grpc.StatusCode.UNAUTHENTICATED
        stats = get_stats(api_pb2.GetStatsRequest(), timeout=10,
                          metadata=secret_metadata(cluster.cluster_secret))
    assert len(stats.workers) == 2


def test_delta_chunks_concatenate_to_the_final_text_on_both_frontends(clients):
    finals = [c.complete("Hello there", max_tokens=16, **GREEDY).outputs[0] for c in clients]
    assert finals[0].text == finals[1].text and finals[0].token_ids == finals[1].token_ids
    chunks = list(clients[1].generate("Hello there", max_tokens=16, **GREEDY))
    assert len(chunks) > 1 and chunks[-1].finished
    assert "".join(c.outputs[0].text for c in chunks) == finals[0].text
    assert [t for c in chunks for t in c.outputs[0].token_ids] == list(finals[0].token_ids)


def test_stop_string_cuts_the_text_and_finishes_with_stop(clients):
    client = clients[0]
    text = client.complete("Tell me", max_tokens=20, **GREEDY).outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    out = client.complete("Tell me", max_tokens=20, stop=stop, **GREEDY).outputs[0]
    assert (out.text, out.finish_reason, out.stop_str) == (text[: text.index(stop)], "stop", stop)
    streamed = "".join(c.outputs[0].text
                       for c in client.generate("Tell me", max_tokens=20, stop=stop, **GREEDY))
    assert streamed == out.text


def test_n2_and_seeded_sampling_reproduce(clients):
    sampled = dict(temperature=0.8, top_p=0.95, max_tokens=10, ignore_eos=True, n=2)

    def texts(client: Client, seed: int) -> list[str]:
        response = client.complete("Pick a color", seed=seed, **sampled)
        return [o.text for o in sorted(response.outputs, key=lambda o: o.index)]

    first = texts(clients[0], 11)
    assert len(first) == 2 and first[0] != first[1]
    assert texts(clients[1], 11) == first  # same seed, other frontend
    assert texts(clients[0], 12) != first


def test_cancelled_stream_frees_its_blocks(clients):
    client = clients[0]
    stream = client.generate(token_ids=random_prompt(1, 40), max_tokens=200, **GREEDY)
    next(stream), next(stream)
    assert sum(w.num_running_reqs for w in client.stats().workers) == 1
    stream.close()
    wait_for(lambda: all_blocks_free(client), what="blocks freed after cancel")


def test_both_workers_receive_work(clients):
    client = clients[0]
    before = {w.worker_id: w.prefix_cache_queries for w in client.stats().workers}
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(
            lambda i: client.complete(token_ids=random_prompt(100 + i, 20), max_tokens=20,
                                      **GREEDY),
            range(8)))
    assert all(len(r.outputs[0].token_ids) == 20 for r in results)
    after = {w.worker_id: w.prefix_cache_queries for w in client.stats().workers}
    assert sorted(after) == ["worker-1", "worker-2"]
    assert all(after[w] > before[w] for w in after), (before, after)


def test_invalid_argument_names_the_field(clients):
    with pytest.raises(grpc.RpcError) as info:
        list(clients[1].generate("hi", top_p=1.5))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "top_p must be in (0, 1], got 1.5"


def test_prompt_too_long_is_invalid_argument(clients):
    with pytest.raises(grpc.RpcError) as info:
        list(clients[0].generate(token_ids=random_prompt(2, 250), max_tokens=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == (
        "prompt has 250 tokens and max_tokens is 10, but max_model_len is 256")


def test_full_waiting_queues_are_resource_exhausted(clients):
    client = clients[0]

    def run(i: int) -> str:
        try:
            response = client.complete(token_ids=random_prompt(200 + i, 8), max_tokens=150,
                                       **GREEDY)
        except grpc.RpcError as e:
            return e.code().name
        return f"{len(response.outputs[0].token_ids)} tokens"

    # 2 workers x (4 running + 4 waiting) hold 16; the rest is refused.
    with ThreadPoolExecutor(24) as pool:
        outcomes = list(pool.map(run, range(24)))
    assert set(outcomes) == {"RESOURCE_EXHAUSTED", "150 tokens"}, outcomes
    assert outcomes.count("150 tokens") >= 8
    wait_for(lambda: all_blocks_free(client), what="blocks freed")


def test_kvmesh_generate_command_streams_the_same_text(cluster, clients):
    expected = clients[0].complete("Hello there", max_tokens=12, temperature=0.0).outputs[0].text
    result = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "generate", "Hello there", "--address",
         cluster.frontend_addresses[1], "--max-tokens", "12"],
        capture_output=True, text=True, timeout=60, check=True,
    )
    assert result.stdout == expected + "\n"
