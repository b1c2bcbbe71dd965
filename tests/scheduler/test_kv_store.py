"""Store mirror of the KV accounting: real valkey and the in-memory store.

The mirror must equal the manager's snapshot after every commit, cost one
round trip per commit, survive a scheduler restart with the same prefix hits,
and start clean when the pool geometry changes.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis

from services.common.sampling_params import SamplingParams
from services.common.block_hash import get_request_block_hasher
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.kv_cache_utils import KVCacheBlock
from services.scheduler.kv_store import InMemoryKVStore, KVStateDelta, KVStore, RedisKVStore
from services.scheduler.request import Request

BLOCK_SIZE = 16
PREFIX = list(range(48))
MODEL = "smollm2"


def make_request(req_id: str, token_ids: list[int]) -> Request:
    return Request(req_id, token_ids, SamplingParams(),
                   block_hasher=get_request_block_hasher(BLOCK_SIZE))


def schedule(manager: KVCacheManager, req: Request, num_new_tokens: int | None = None) -> list[int]:
    computed: list[KVCacheBlock] = []
    num_computed = 0
    if req.num_computed_tokens == 0:
        computed, num_computed = manager.get_computed_blocks(req)
    if num_new_tokens is None:
        num_new_tokens = req.num_tokens - num_computed
    new_blocks = manager.allocate_slots(req, num_new_tokens, num_computed, computed)
    assert new_blocks is not None
    req.num_computed_tokens += num_computed + num_new_tokens
    return [b.block_id for b in new_blocks]


def free_ids(manager: KVCacheManager) -> list[int]:
    return [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]


@pytest.fixture(params=["memory", "redis"])
def make_store(request: pytest.FixtureRequest) -> Callable[[], KVStore]:
    """Returns a factory; every call opens the SAME backing state (a restart)."""
    if request.param == "memory":
        store = InMemoryKVStore()
        return lambda: store
    url = request.getfixturevalue("redis_url")
    return lambda: RedisKVStore(url, MODEL, "worker-0")


def run_workload(manager: KVCacheManager, store: KVStore) -> Request:
    """Allocate / free / commit cycles; returns r1, still holding [1, 2, 3, 5]."""
    req0 = make_request("r0", PREFIX + list(range(100, 107)))
    req1 = make_request("r1", PREFIX + list(range(200, 205)))
    assert schedule(manager, req0) == [1, 2, 3, 4]
    manager.commit()
    assert store.load() == manager.snapshot()
    assert schedule(manager, req1) == [5]
    manager.commit()
    assert store.load() == manager.snapshot()
    manager.free(req0)
    manager.commit()
    assert store.load() == manager.snapshot()
    req2 = make_request("r2", list(range(1000, 1040)))  # caches 6, 7
    assert schedule(manager, req2) == [6, 7, 8]
    manager.free(req2)
    manager.commit()
    assert free_ids(manager) == [9, 10, 4, 8, 7, 6]
    return req1


def test_mirror_equals_snapshot_after_every_commit(make_store):
    store = make_store()
    manager = KVCacheManager(11, BLOCK_SIZE, 1024, store=store)
    assert store.load() == manager.snapshot()
    req1 = run_workload(manager, store)
    snap = store.load()
    assert snap == manager.snapshot()
    assert (snap.num_blocks, snap.block_size, snap.num_free_blocks) == (11, 16, 6)
    assert snap.req_blocks == {"r1": [1, 2, 3, 5]}
    assert snap.free_order == [7, 6]
    assert sorted(ids[0] for ids in snap.cached.values()) == [1, 2, 3, 6, 7]
    assert snap.block_token_ids[6] == list(range(1000, 1016))

    # Evict a cached block (7) while caching five new ones, free all, reset.
    big = make_request("big", list(range(2000, 2100)))
    assert schedule(manager, big, 80) == [9, 10, 4, 8, 7]
    manager.commit()
    assert store.load() == manager.snapshot()
    assert store.load().free_order == [6]
    manager.free(big)
    manager.free(req1)
    manager.commit()
    assert store.load() == manager.snapshot()
    assert manager.reset_prefix_cache() is True
    manager.commit()
    snap = store.load()
    assert snap == manager.snapshot()
    assert (snap.cached, snap.block_token_ids, snap.free_order, snap.req_blocks) == ({}, {}, [], {})


def test_blocks_sharing_a_hash_are_mirrored(make_store):
    store = make_store()
    manager = KVCacheManager(11, BLOCK_SIZE, 1024, store=store)
    tokens = PREFIX[:32] + [1]
    req_x, req_y = make_request("x", tokens), make_request("y", tokens)
    schedule(manager, req_x, 10)
    schedule(manager, req_y, 10)
    schedule(manager, req_x, 23)
    schedule(manager, req_y, 23)
    manager.commit()
    snap = store.load()
    assert snap == manager.snapshot()
    assert snap.cached[req_x.block_hashes[0].hex()] == [1, 2]
    assert snap.cached[req_x.block_hashes[1].hex()] == [3, 5]


def test_restart_keeps_prefix_hits_and_rebuilds_the_free_queue(make_store):
    old = KVCacheManager(11, BLOCK_SIZE, 1024, store=make_store())
    run_workload(old, old.store)  # r1 still holds [1, 2, 3, 5] when the scheduler "dies"
    cached_before = old.snapshot().cached

    new = KVCacheManager(11, BLOCK_SIZE, 1024, store=make_store())
    assert new.num_free_blocks == 10
    assert new.num_cached_blocks == 5
    # Uncached first, then cached free blocks in their old order, then what r1
    # held, as if r1 were freed now (tail first).
    assert free_ids(new) == [4, 5, 8, 9, 10, 7, 6, 3, 2, 1]
    assert all(b.ref_cnt == 0 for b in new.block_pool.blocks)
    snap = new.store.load()
    assert snap == new.snapshot()
    assert snap.req_blocks == {}
    assert snap.cached == cached_before
    assert snap.free_order == [7, 6, 3, 2, 1]

    req = make_request("r3", PREFIX + [9, 9, 9, 9, 9])
    computed, num_computed = new.get_computed_blocks(req)
    assert ([b.block_id for b in computed], num_computed) == ([1, 2, 3], 48)
    assert schedule(new, req) == [4]
    new.commit()
    assert new.store.load() == new.snapshot()


def test_restored_blocks_keep_the_collision_check(make_store):
    old = KVCacheManager(11, BLOCK_SIZE, 1024, store=make_store())
    run_workload(old, old.store)
    new = KVCacheManager(11, BLOCK_SIZE, 1024, store=make_store())
    impostor = make_request("imp", list(range(700, 753)))
    impostor.block_hashes = [new.block_pool.blocks[i].block_hash for i in (1, 2, 3)]
    assert new.get_computed_blocks(impostor) == ([], 0)


@pytest.mark.parametrize("num_blocks, block_size", [(12, 16), (11, 32)])
def test_different_geometry_starts_clean(make_store, num_blocks: int, block_size: int):
    old = KVCacheManager(11, BLOCK_SIZE, 1024, store=make_store())
    run_workload(old, old.store)
    new = KVCacheManager(num_blocks, block_size, 1024, store=make_store())
    assert new.num_cached_blocks == 0
    assert free_ids(new) == list(range(1, num_blocks))
    snap = new.store.load()
    assert snap == new.snapshot()
    assert (snap.num_blocks, snap.block_size, snap.num_free_blocks) == (num_blocks, block_size,
                                                                       num_blocks - 1)
    assert (snap.cached, snap.block_token_ids, snap.free_order, snap.req_blocks) == ({}, {}, [], {})


def test_disabled_caching_does_not_restore(make_store):
    old = KVCacheManager(11, BLOCK_SIZE, 1024, store=make_store())
    run_workload(old, old.store)
    new = KVCacheManager(11, BLOCK_SIZE, 1024, enable_caching=False, store=make_store())
    assert new.num_cached_blocks == 0
    assert new.store.load().cached == {}


class RoundTripCounter:
    """Counts pipeline executions and direct commands on a redis-py client."""

    def __init__(self, client: redis.Redis) -> None:
        self.num_executes = 0
        self.num_direct_commands = 0
        make_pipeline, direct = client.pipeline, client.execute_command

        def pipeline(*args, **kwargs):
            pipe = make_pipeline(*args, **kwargs)
            execute = pipe.execute

            def counted_execute(*a, **kw):
                self.num_executes += 1
                return execute(*a, **kw)

            pipe.execute = counted_execute
            return pipe

        def execute_command(*args, **kwargs):
            self.num_direct_commands += 1
            return direct(*args, **kwargs)

        client.pipeline = pipeline
        client.execute_command = execute_command


def test_commit_is_one_round_trip(redis_url: str):
    store = RedisKVStore(redis_url, MODEL, "worker-0")
    manager = KVCacheManager(11, BLOCK_SIZE, 1024, store=store)
    counter = RoundTripCounter(store.client)

    # One busy step: three requests, prefix hits, cached blocks, a free.
    req0 = make_request("r0", PREFIX + list(range(100, 107)))
    req1 = make_request("r1", PREFIX + [5])
    assert schedule(manager, req0) == [1, 2, 3, 4]
    assert schedule(manager, req1) == [5]
    assert schedule(manager, make_request("r2", list(range(3000, 3060)))) == [6, 7, 8, 9]
    manager.free(req0)
    manager.commit()
    assert (counter.num_executes, counter.num_direct_commands) == (1, 0)

    manager.commit()  # nothing changed: no round trip at all
    assert (counter.num_executes, counter.num_direct_commands) == (1, 0)

    req1.append_output_token_ids(6)
    assert manager.allocate_slots(req1, 1) == []  # decode inside a block: nothing to mirror
    manager.commit()
    assert (counter.num_executes, counter.num_direct_commands) == (1, 0)
    assert store.load() == manager.snapshot()


def test_keys_are_namespaced_by_model_and_worker(redis_url: str):
    store = RedisKVStore(redis_url, MODEL, "worker-0")
    manager = KVCacheManager(11, BLOCK_SIZE, 1024, store=store)
    schedule(manager, make_request("r", PREFIX + [1]))
    manager.commit()
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    prefix = f"kvmesh:{MODEL}:worker-0:"
    assert sorted(client.keys("*")) == [prefix + k for k in
                                        ("block_tokens", "meta", "prefix", "req_blocks")]
    assert client.hgetall(prefix + "meta") == {"num_blocks": "11", "block_size": "16",
                                               "num_free_blocks": "6"}
    assert client.hget(prefix + "req_blocks", "r") == "1,2,3,4"
    assert RedisKVStore(redis_url, MODEL, "worker-1").load() is None
    assert RedisKVStore(redis_url, "other-model", "worker-0").load() is None
    client.close()


def test_in_memory_store_applies_deletes_and_clear():
    store = InMemoryKVStore()
    assert store.load() is None
    store.apply(KVStateDelta(5, 16, 3, prefix_index={"ab": [1, 2]}, block_token_ids={1: [7]},
                             free_seq={1: 4, 2: 3}, req_blocks={"r": [3]}))
    snap = store.load()
    assert (snap.cached, snap.block_token_ids, snap.free_order, snap.req_blocks) == (
        {"ab": [1, 2]}, {1: [7]}, [2, 1], {"r": [3]})
    store.apply(KVStateDelta(5, 16, 4, prefix_index={"ab": None}, free_seq={2: None},
                             req_blocks={"r": None}))
    snap = store.load()
    assert (snap.num_free_blocks, snap.cached, snap.free_order, snap.req_blocks) == (4, {}, [1], {})
    store.apply(KVStateDelta(6, 16, 5, clear=True))
    snap = store.load()
    assert (snap.num_blocks, snap.block_token_ids, snap.free_order) == (6, {}, [])
