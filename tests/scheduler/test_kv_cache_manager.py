"""KVCacheManager and BlockPool: prefix hits, allocation, eviction order (block_size 16)."""

from __future__ import annotations

import pytest

from services.common.sampling_params import SamplingParams
from services.common.block_hash import get_request_block_hasher
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request

BLOCK_SIZE = 16
PREFIX = list(range(48))  # three full blocks shared by several prompts


def make_request(req_id: str, token_ids: list[int], cache_salt: str | None = None,
                 **params: object) -> Request:
    return Request(req_id, token_ids, SamplingParams(**params), cache_salt=cache_salt,
                   block_hasher=get_request_block_hasher(BLOCK_SIZE))


def schedule(manager: KVCacheManager, req: Request, num_new_tokens: int | None = None) -> list[int]:
    """What the scheduler does for one request in one step; returns the new block ids."""
    computed, num_computed = [], 0
    if req.num_computed_tokens == 0:
        computed, num_computed = manager.get_computed_blocks(req)
    if num_new_tokens is None:
        num_new_tokens = req.num_tokens - req.num_computed_tokens - num_computed
    new_blocks = manager.allocate_slots(req, num_new_tokens, num_computed, computed)
    assert new_blocks is not None
    req.num_computed_tokens += num_computed + num_new_tokens
    return [b.block_id for b in new_blocks]


def free_ids(manager: KVCacheManager) -> list[int]:
    return [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]


def ref_cnts(manager: KVCacheManager, block_ids: list[int]) -> list[int]:
    return [manager.block_pool.blocks[i].ref_cnt for i in block_ids]


@pytest.fixture
def manager() -> KVCacheManager:
    return KVCacheManager(num_blocks=11, block_size=BLOCK_SIZE, max_model_len=1024)


def test_prefill_shares_the_common_prefix(manager: KVCacheManager):
    req0 = make_request("r0", PREFIX + list(range(100, 107)))  # 55 tokens
    assert manager.get_computed_blocks(req0) == ([], 0)
    assert [b.block_id for b in manager.allocate_slots(req0, 55)] == [1, 2, 3, 4]
    assert manager.num_cached_blocks == 3  # the three full blocks

    req1 = make_request("r1", PREFIX + list(range(200, 205)))  # 53 tokens
    computed, num_computed = manager.get_computed_blocks(req1)
    assert [b.block_id for b in computed] == [1, 2, 3]
    assert num_computed == 48
    new_blocks = manager.allocate_slots(req1, 5, num_computed, computed)
    assert [b.block_id for b in new_blocks] == [5]
    assert manager.get_block_ids("r1") == [1, 2, 3, 5]
    assert ref_cnts(manager, [1, 2, 3, 4, 5]) == [2, 2, 2, 1, 1]
    assert manager.num_free_blocks == 5
    assert manager.usage == pytest.approx(0.5)

    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 108, 48)
    assert manager.make_prefix_cache_stats().queries == 0


def test_free_appends_tail_first_and_later_request_hits(manager: KVCacheManager):
    req0 = make_request("r0", PREFIX + list(range(100, 107)))
    req1 = make_request("r1", PREFIX + list(range(200, 205)))
    schedule(manager, req0)  # [1, 2, 3, 4]
    schedule(manager, req1)  # hits [1, 2, 3], new [5]
    manager.free(req0)  # 4 reaches 0; 3, 2, 1 still held by r1
    assert free_ids(manager) == [6, 7, 8, 9, 10, 4]
    manager.free(req1)
    assert free_ids(manager) == [6, 7, 8, 9, 10, 4, 5, 3, 2, 1]
    assert manager.num_cached_blocks == 3  # freed blocks stay cached

    req2 = make_request("r2", PREFIX[:32] + [300, 301, 302])  # 35 tokens
    computed, num_computed = manager.get_computed_blocks(req2)
    assert ([b.block_id for b in computed], num_computed) == ([1, 2], 32)
    assert schedule(manager, req2) == [6]
    assert manager.get_block_ids("r2") == [1, 2, 6]
    assert free_ids(manager) == [7, 8, 9, 10, 4, 5, 3]


def test_fully_cached_prompt_recomputes_its_last_block(manager: KVCacheManager):
    schedule(manager, make_request("r0", PREFIX + [1000]))  # caches 3 blocks
    req = make_request("r1", list(PREFIX))  # exactly 48 tokens, all cached
    computed, num_computed = manager.get_computed_blocks(req)
    assert ([b.block_id for b in computed], num_computed) == ([1, 2], 32)


def test_cache_salt_isolates_prefixes(manager: KVCacheManager):
    tokens = PREFIX + [7]
    schedule(manager, make_request("a", tokens, cache_salt="tenant-a"))
    assert manager.get_computed_blocks(make_request("b", tokens, cache_salt="tenant-b")) == ([], 0)
    assert manager.get_computed_blocks(make_request("c", tokens)) == ([], 0)
    same_salt = make_request("d", tokens, cache_salt="tenant-a")
    computed, num_computed = manager.get_computed_blocks(same_salt)
    assert ([b.block_id for b in computed], num_computed) == ([1, 2, 3], 48)


def test_prompt_logprobs_and_disabled_caching_skip_the_lookup(manager: KVCacheManager):
    schedule(manager, make_request("r0", PREFIX + [7]))
    wants_logprobs = make_request("r1", PREFIX + [7], prompt_logprobs=1)
    assert manager.get_computed_blocks(wants_logprobs) == ([], 0)
    off = KVCacheManager(num_blocks=11, block_size=BLOCK_SIZE, max_model_len=1024,
                         enable_caching=False)
    schedule(off, make_request("r0", PREFIX + [7]))
    assert off.num_cached_blocks == 0
    assert off.get_computed_blocks(make_request("r1", PREFIX + [7])) == ([], 0)


def test_hash_collision_is_not_served(manager: KVCacheManager):
    schedule(manager, make_request("r0", PREFIX + [7]))
    other = make_request("r1", list(range(500, 548)) + [7])
    # Pretend sha256 collided: r1's blocks carry r0's hashes, not its tokens.
    other.block_hashes = [manager.block_pool.blocks[i].block_hash for i in (1, 2, 3)]
    assert manager.get_computed_blocks(other) == ([], 0)
    # The same hashes with the right tokens do hit.
    assert manager.get_computed_blocks(make_request("r2", PREFIX + [8]))[1] == 48


def test_allocate_slots_out_of_room_changes_nothing():
    manager = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE, max_model_len=1024)
    req_a = make_request("a", PREFIX[:32] + [1])  # 33 tokens: [1, 2, 3], caches 1, 2
    schedule(manager, req_a)
    manager.free(req_a)
    assert free_ids(manager) == [4, 3, 2, 1]
    index = manager.block_pool.cached_block_hash_to_block
    cached_before = {h: dict(blocks) for h, blocks in index.items()}

    # Hits [1, 2] (both free) and needs 3 more: 5 blocks > 4 free.
    req_b = make_request("b", PREFIX[:32] + list(range(600, 638)))  # 70 tokens
    computed, num_computed = manager.get_computed_blocks(req_b)
    assert [b.block_id for b in computed] == [1, 2]
    assert manager.allocate_slots(req_b, 70 - num_computed, num_computed, computed) is None
    assert free_ids(manager) == [4, 3, 2, 1]
    assert manager.num_free_blocks == 4
    assert ref_cnts(manager, [1, 2, 3, 4]) == [0, 0, 0, 0]
    assert manager.block_pool.cached_block_hash_to_block == cached_before
    assert "b" not in manager.req_to_blocks

    # 62 tokens: 2 hits + 2 new = 4 blocks fits exactly.
    req_c = make_request("c", PREFIX[:32] + list(range(600, 630)))
    assert schedule(manager, req_c) == [4, 3]
    assert manager.get_block_ids("c") == [1, 2, 4, 3]
    assert manager.num_free_blocks == 0
    assert manager.allocate_slots(make_request("d", [1]), 1) is None


def test_eviction_takes_the_head_and_unindexes_it():
    manager = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE, max_model_len=1024)
    tokens_a = PREFIX[:32] + [1]
    req_a = make_request("a", tokens_a)
    schedule(manager, req_a)  # [1, 2, 3]; 1 and 2 cached
    hash0, hash1 = req_a.block_hashes
    manager.free(req_a)
    assert free_ids(manager) == [4, 3, 2, 1]

    assert schedule(manager, make_request("b", [9] * 20)) == [4, 3]  # uncached: no eviction
    assert manager.num_cached_blocks == 3  # a's two blocks and b's first
    assert schedule(manager, make_request("c", [8] * 10)) == [2]  # evicts a's SECOND block
    pool = manager.block_pool
    assert hash1 not in pool.cached_block_hash_to_block
    assert pool.blocks[2].block_hash is None and pool.blocks[2].token_ids is None
    assert hash0 in pool.cached_block_hash_to_block
    assert manager.num_cached_blocks == 2
    computed, num_computed = manager.get_computed_blocks(make_request("a2", tokens_a))
    assert ([b.block_id for b in computed], num_computed) == ([1], 16)


def test_blocks_computed_concurrently_share_a_hash(manager: KVCacheManager):
    tokens = PREFIX[:32] + [1]
    req_x, req_y = make_request("x", tokens), make_request("y", tokens)
    # Chunked prefill: both start before either has a full block cached.
    assert schedule(manager, req_x, 10) == [1]
    assert schedule(manager, req_y, 10) == [2]
    assert schedule(manager, req_x, 23) == [3, 4]
    assert schedule(manager, req_y, 23) == [5, 6]
    pool = manager.block_pool
    assert sorted(pool.cached_block_hash_to_block[req_x.block_hashes[0]]) == [1, 2]
    assert sorted(pool.cached_block_hash_to_block[req_x.block_hashes[1]]) == [3, 5]
    assert manager.num_cached_blocks == 4
    computed, _ = manager.get_computed_blocks(make_request("z", tokens))
    assert [b.block_id for b in computed] == [1, 3]  # first cached copy wins

    manager.free(req_y)  # 6, 5, 2 to the tail
    manager.free(req_x)  # 4, 3, 1 to the tail
    assert free_ids(manager) == [7, 8, 9, 10, 6, 5, 2, 4, 3, 1]
    schedule(manager, make_request("big", list(range(900, 1000))))  # 100 tokens: 7 blocks
    # Pops 7..10, 6, 5, 2: y's copies are evicted, x's stay indexed.
    assert sorted(pool.cached_block_hash_to_block[req_x.block_hashes[0]]) == [1]
    assert sorted(pool.cached_block_hash_to_block[req_x.block_hashes[1]]) == [3]


def test_decode_caches_a_block_once_it_fills(manager: KVCacheManager):
    req = make_request("r", list(range(30)))
    assert schedule(manager, req) == [1, 2]
    assert manager.num_cached_blocks == 1
    req.append_output_token_ids(100)  # 31 tokens
    assert schedule(manager, req, 1) == []
    assert manager.num_cached_blocks == 1
    req.append_output_token_ids(101)  # 32 tokens: block 2 fills this step
    assert schedule(manager, req, 1) == []
    assert manager.num_cached_blocks == 2
    assert manager.block_pool.cached_block_hash_to_block[req.block_hashes[1]] == {
        2: manager.block_pool.blocks[2]}
    assert manager.block_pool.blocks[2].token_ids == tuple(list(range(16, 30)) + [100, 101])
    req.append_output_token_ids(102)
    assert schedule(manager, req, 1) == [3]


def test_lookahead_reserves_slots_without_caching(manager: KVCacheManager):
    req = make_request("r", list(range(16)))
    new_blocks = manager.allocate_slots(req, 16, num_lookahead_tokens=4)
    assert [b.block_id for b in new_blocks] == [1, 2]
    assert manager.num_cached_blocks == 1


def test_max_model_len_caps_the_blocks_allocated():
    manager = KVCacheManager(num_blocks=11, block_size=BLOCK_SIZE, max_model_len=20)
    req = make_request("r", list(range(16)))
    assert [b.block_id for b in manager.allocate_slots(req, 16, num_lookahead_tokens=30)] == [1, 2]


def test_reset_prefix_cache_only_when_idle(manager: KVCacheManager):
    req = make_request("r", PREFIX + [1])
    schedule(manager, req)
    assert manager.reset_prefix_cache() is False
    assert manager.num_cached_blocks == 3
    manager.free(req)
    assert manager.reset_prefix_cache() is True
    assert manager.num_cached_blocks == 0
    assert manager.block_pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in manager.block_pool.blocks)
    assert manager.get_computed_blocks(make_request("r2", PREFIX + [1])) == ([], 0)


def test_can_fit_counts_usable_blocks(manager: KVCacheManager):
    assert manager.can_fit(160) is True  # 10 blocks
    assert manager.can_fit(161) is False


def test_bad_arguments_raise_with_the_allowed_range(manager: KVCacheManager):
    with pytest.raises(ValueError, match="num_blocks is 1, must be >= 2"):
        KVCacheManager(num_blocks=1, block_size=16, max_model_len=16)
    with pytest.raises(ValueError, match="block_size is 0, must be >= 1"):
        KVCacheManager(num_blocks=4, block_size=0, max_model_len=16)
    with pytest.raises(ValueError, match="num_new_tokens is 0, must be >= 1"):
        manager.allocate_slots(make_request("r", [1]), 0)
