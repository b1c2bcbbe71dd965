"""Two cells (a scheduler and its worker each) behind one frontend, real processes
and a real Redis: prefix routing, load spreading, a scheduler or a cell's only
worker SIGKILLed under 16 greedy streams, Redis killed and back, a restarted scheduler's generation,
and an index nobody writes without the password.
"""

from __future__ import annotations

import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from kvmesh.client import Client
from kvmesh.cluster import LocalCluster, ServiceProcess
from services.common.cell_index import cell_key
from tests.e2e.helpers import GREEDY, Streams, prompts, reference, tiny_cluster_config, wait_for

PREFIX_TOKENS = 128  # 8 full blocks of 16
NUM_STREAMS = 16


@pytest.fixture(scope="module")
def cluster(make_cluster, tiny_model_dir, tmp_path_factory) -> LocalCluster:
    config = tiny_cluster_config(tiny_model_dir, tmp_path_factory.mktemp("logs"),
                                 num_schedulers=2, num_workers=2, num_frontends=1)
    return make_cluster(config)


@pytest.fixture
def client(cluster: LocalCluster):
    with Client(cluster.address, timeout_s=120) as client:
        wait_for(lambda: both_cells_serve(client), 60, "two cells with a worker each")
        yield client


def both_cells_serve(client: Client) -> bool:
    cells = client.stats().cells
    return len(cells) == 2 and all(c.connected and c.num_workers == 1 for c in cells)


def routed(client: Client) -> dict[str, dict[str, int]]:
    """Requests the frontend sent to each cell so far, by reason."""
    return {c.cell_id: dict(c.routed_requests) for c in client.stats().cells}


def routed_since(before: dict, after: dict, reason: str) -> dict[str, int]:
    return {cell: after[cell].get(reason, 0) - before.get(cell, {}).get(reason, 0)
            for cell in after}


def redis_client(cluster: LocalCluster) -> redis.Redis:
    return redis.Redis.from_url(cluster.redis_url, decode_responses=True)


def cell_record(cluster: LocalCluster, cell_id: str) -> dict[str, str]:
    client = redis_client(cluster)
    try:
        keys = client.keys(f"kvmesh:*:cell:{cell_id}:record")
        return client.hgetall(keys[0]) if keys else {}
    finally:
        client.close()


def kill(process: ServiceProcess) -> None:
    process.signal(signal.SIGKILL)
    process.popen.wait(10)


def restart_killed(cluster: LocalCluster, client: Client) -> None:
    """Restarts what was killed (as ``kvmesh up`` does, with its backoff) until both cells serve."""
    def restarted() -> bool:
        cluster.supervise()
        return both_cells_serve(client)

    wait_for(restarted, 90, "the restarted cell to serve")


def complete(client: Client, token_ids: list[int], max_tokens: int = 4):
    return client.complete(token_ids=token_ids, max_tokens=max_tokens, **GREEDY)


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


def test_requests_sharing_a_prefix_land_on_the_cell_that_holds_it(cluster, client):
    rng = random.Random(1)
    prefixes = [random_tokens(rng, PREFIX_TOKENS) for _ in range(2)]
    before = routed(client)
    # Sent together, load alone puts one prefix in each cell.
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda p: complete(client, p + random_tokens(rng, 8), 16), prefixes))
    assert sorted(routed_since(before, routed(client), "load").values()) == [1, 1]
    time.sleep(0.5)  # the cells publish their new entries
    # Each later request goes where its prefix is; load alone would send every
    # one to the same idle cell and half would miss.
    before = routed(client)
    for _ in range(3):
        for prefix in prefixes:
            output = complete(client, prefix + random_tokens(rng, 8))
            assert output.metrics.num_cached_tokens >= PREFIX_TOKENS
    assert sorted(routed_since(before, routed(client), "prefix").values()) == [3, 3]


def test_without_a_shared_prefix_load_spreads(cluster, client):
    before = routed(client)
    with ThreadPoolExecutor(NUM_STREAMS) as pool:
        list(pool.map(lambda p: complete(client, p, 24), prompts(7, NUM_STREAMS)))
    counts = routed_since(before, routed(client), "load")
    assert sum(counts.values()) == NUM_STREAMS
    # Stated tolerance: within 3 of an even split.
    assert all(abs(n - NUM_STREAMS // 2) <= 3 for n in counts.values()), counts


def test_sigkill_a_scheduler_under_16_greedy_streams_changes_no_output(cluster, client):
    token_prompts = prompts(11, NUM_STREAMS)
    expected = reference(client, token_prompts)
    streams = Streams(client, token_prompts)
    # Mid-generation: some streams are a few tokens in, the rest still queued.
    wait_for(lambda: max(map(len, streams.tokens)) >= 5, 60, "the first tokens")
    victim = cluster.schedulers[0]
    killed_at = time.monotonic()
    kill(victim)
    streams.join(180)
    assert streams.errors == [None] * NUM_STREAMS
    assert streams.tokens == expected
    # Every request of the dead cell went to the live one, with its tokens so far.
    assert sum(c.routed_requests.get("resubmit", 0) for c in client.stats().cells) > 0
    print(f"all {NUM_STREAMS} streams finished {time.monotonic() - killed_at:.1f}s after the kill")
    restart_killed(cluster, client)


def test_sigkill_the_only_worker_of_a_cell_moves_its_streams_to_the_other(cluster, client):
    token_prompts = prompts(17, NUM_STREAMS)
    expected = reference(client, token_prompts)
    streams = Streams(client, token_prompts)
    wait_for(lambda: max(map(len, streams.tokens)) >= 5, 60, "the first tokens")
    kill(cluster.workers[0])  # cell-0 has no worker left
    streams.join(180)
    assert streams.errors == [None] * NUM_STREAMS
    assert streams.tokens == expected
    restart_killed(cluster, client)


def test_a_restarted_scheduler_replaces_its_entries_with_a_new_generation(cluster, client):
    rng = random.Random(3)
    complete(client, random_tokens(rng, PREFIX_TOKENS + 8), 4)
    wait_for(lambda: cell_record(cluster, "cell-0").get("generation"), 10, "cell-0's record")
    old_generation = int(cell_record(cluster, "cell-0")["generation"])
    kill(cluster.schedulers[0])
    restart_killed(cluster, client)
    wait_for(lambda: int(cell_record(cluster, "cell-0").get("generation", 0)) > old_generation,
             30, "cell-0's new generation")
    generation = cell_record(cluster, "cell-0")["generation"]
    r = redis_client(cluster)
    try:
        blocks_key = r.keys("kvmesh:*:cell:cell-0:blocks")
        entries = r.hgetall(blocks_key[0]) if blocks_key else {}
    finally:
        r.close()
    assert set(entries.values()) <= {generation}  # nothing of the old generation is left


def test_a_dead_cells_entries_route_nothing(cluster, client):
    rng = random.Random(5)
    prefix = random_tokens(rng, PREFIX_TOKENS)
    # Warm the prefix, then find its cell by where the next request lands.
    complete(client, prefix + random_tokens(rng, 8))
    time.sleep(0.5)
    before = routed(client)
    complete(client, prefix + random_tokens(rng, 8))
    holder = next(cell for cell, n in routed_since(before, routed(client), "prefix").items() if n)
    victim = cluster.schedulers[int(holder.rsplit("-", 1)[1])]
    kill(victim)
    r = redis_client(cluster)
    try:
        # Its entries are still in Redis (until its lease runs out) ...
        assert r.keys(f"kvmesh:*:cell:{holder}:blocks")
    finally:
        r.close()
    wait_for(lambda: not next(c for c in client.stats().cells if c.cell_id == holder).connected,
             10, "the frontend to see the cell gone")
    before = routed(client)
    output = complete(client, prefix + random_tokens(rng, 8), 8)
    # ... and route nothing: the request lands on the live cell, as a miss.
    assert output.outputs[0].token_ids and output.metrics.num_cached_tokens == 0
    moved = routed_since(before, routed(client), "load")
    assert moved[holder] == 0 and sum(moved.values()) == 1
    restart_killed(cluster, client)


def test_serving_goes_on_without_redis_and_prefix_routing_returns(cluster, client):
    rng = random.Random(9)
    prefix = random_tokens(rng, PREFIX_TOKENS)
    complete(client, prefix + random_tokens(rng, 8))
    os.kill(cluster.redis.pid, signal.SIGKILL)
    before = routed(client)
    for token_prompt in prompts(13, 4):
        assert complete(client, token_prompt, 8).outputs[0].token_ids
    assert sum(routed_since(before, routed(client), "fallback").values()) == 4
    wait_for(lambda: "redis" in cluster.supervise(), 30, "Redis restarted")
    # Back, empty: the cells publish everything again.
    complete(client, prefix + random_tokens(rng, 8))  # warm again wherever it lands

    def prefix_routed() -> bool:
        before = routed(client)
        complete(client, prefix + random_tokens(rng, 8))
        return sum(routed_since(before, routed(client), "prefix").values()) == 1

    wait_for(prefix_routed, 20, "prefix routing after Redis came back")


def test_the_index_cannot_be_written_without_the_redis_password(cluster):
    url = f"redis://127.0.0.1:{cluster.redis.port}/0"
    outsider = redis.Redis.from_url(url, decode_responses=True)
    try:
        with pytest.raises(redis.exceptions.AuthenticationError):
            outsider.hset(cell_key("m", "cell-0", "blocks"), "deadbeef", "1")
    finally:
        outsider.close()
