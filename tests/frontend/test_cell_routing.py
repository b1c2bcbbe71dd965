"""Routing between cells: the formula, and the Redis index as the frontend reads it."""

from __future__ import annotations

import asyncio

import redis

from services.common.block_hash import get_request_block_hasher
from services.common.cell_index import CellRecord, cell_key
from services.frontend.cell_routing import CellCandidate, choose_cell, routing_cost
from services.frontend.prefix_index import PrefixIndexReader, prompt_block_hashes


def test_cost_is_uncached_prefill_plus_load_per_worker() -> None:
    cell = CellCandidate("a", num_workers=2, load_tokens=300, hit_tokens=64)
    assert routing_cost(cell, 100, prefill_weight=1.0) == 36 + 150
    assert routing_cost(cell, 100, prefill_weight=2.0) == 72 + 150


def test_a_cached_prefix_beats_a_little_load_but_not_a_lot() -> None:
    holder = CellCandidate("a", 1, load_tokens=100, hit_tokens=512)
    idle = CellCandidate("b", 1, load_tokens=0)
    assert choose_cell([idle, holder], 600) == 1
    swamped = CellCandidate("a", 1, load_tokens=5000, hit_tokens=512)
    assert choose_cell([idle, swamped], 600) == 0


def test_ties_go_to_the_less_loaded_then_the_first() -> None:
    a, b = CellCandidate("a", 2, 100), CellCandidate("b", 1, 50)
    assert choose_cell([a, b], 10) == 1  # same cost (50 per worker): b has less load
    assert choose_cell([CellCandidate("a", 1, 0), CellCandidate("b", 1, 0)], 10) == 0


class _Tokens:
    def __init__(self, token_ids: list[int], cache_salt: str | None) -> None:
        self.all_token_ids, self.block_hashes, self.cache_salt = token_ids, [], cache_salt


def test_prompt_hashes_are_the_schedulers_and_stop_short_of_the_last_token() -> None:
    token_ids = list(range(100, 148))  # 3 full blocks of 16
    for salt in (None, "tenant-a"):
        scheduler_hashes = get_request_block_hasher(16)(_Tokens(token_ids, salt))
        assert prompt_block_hashes(token_ids, 16, salt) == [h.hex() for h in scheduler_hashes[:2]]
    assert prompt_block_hashes(token_ids, 16, "x") != prompt_block_hashes(token_ids, 16, None)


def test_reader_trusts_only_live_records_of_the_same_generation(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    hashes = ["h0", "h1", "h2"]
    client.hset(cell_key("m", "live", "record"),
                mapping=CellRecord(generation=3, block_size=16, num_workers=1).to_fields())
    client.hset(cell_key("m", "live", "blocks"), mapping={"h0": "3", "h1": "3", "h2": "2"})
    # A dead cell: its record expired, its entries did not (yet).
    client.hset(cell_key("m", "dead", "blocks"), mapping={"h0": "1", "h1": "1", "h2": "1"})
    client.close()

    async def lookup() -> dict:
        reader = PrefixIndexReader(redis_url)
        try:
            return await reader.lookup("m", [("live", hashes), ("dead", hashes)])
        finally:
            await reader.close()

    found = asyncio.run(lookup())
    assert found["live"].num_hit_blocks == 2  # h2 is an older generation's
    assert found["dead"].record is None and found["dead"].num_hit_blocks == 0


def test_reader_counts_leading_hits_past_one_chunk_and_on_long_prompts(redis_url: str) -> None:
    """The script reads hashes in growing chunks: a run of hits crosses chunks
    and stops at the first miss; a prompt of 5,000 blocks is one call too."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    hashes = [f"h{i:04d}" for i in range(5000)]
    for cell_id, held in (("all", 5000), ("some", 70), ("gap", 130)):
        client.hset(cell_key("m2", cell_id, "record"),
                    mapping=CellRecord(generation=1, block_size=16).to_fields())
        client.hset(cell_key("m2", cell_id, "blocks"), mapping=dict.fromkeys(hashes[:held], "1"))
    client.hdel(cell_key("m2", "gap", "blocks"), "h0100")  # held after the gap: not leading
    client.close()

    async def lookup() -> dict:
        reader = PrefixIndexReader(redis_url, timeout_s=5)
        try:
            return await reader.lookup("m2", [(c, hashes) for c in ("all", "some", "gap", "none")])
        finally:
            await reader.close()

    found = asyncio.run(lookup())
    assert {c: found[c].num_hit_blocks for c in found} == {
        "all": 5000, "some": 70, "gap": 100, "none": 0}
    assert found["all"].record == CellRecord(generation=1, block_size=16)


def test_reader_falls_back_fast_when_redis_is_gone() -> None:
    async def lookup() -> tuple:
        reader = PrefixIndexReader("redis://127.0.0.1:1/0", retry_after_s=60)
        try:
            first = await reader.lookup("m", [("c", ["h0"])])
            return first, reader.available, await reader.lookup("m", [("c", ["h0"])])
        finally:
            await reader.close()

    first, available, second = asyncio.run(lookup())
    assert first is None and not available and second is None
