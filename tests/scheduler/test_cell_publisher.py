"""The cell's Redis record and prefix entries, against a real valkey-server."""

from __future__ import annotations

import asyncio
import time

import redis

from services.common.cell_index import CellRecord, cell_key
from services.common.redis_server import EmbeddedRedis
from services.scheduler.cell_publisher import CellIndex, CellPublisher
from services.scheduler.kv_store import KVStateDelta

MODEL = "m"


def delta(prefix: dict[str, list[int] | None], *, clear: bool = False,
          block_size: int = 16) -> KVStateDelta:
    return KVStateDelta(64, block_size, 10, clear=clear, prefix_index=prefix)


def publisher(url: str, index: CellIndex, cell_id: str = "c0", **kwargs) -> CellPublisher:
    return CellPublisher(url, cell_id, index, lambda: MODEL,
                         lambda: CellRecord(block_size=16, num_workers=1, prefill_tokens=7),
                         **kwargs)


def read_cell(url: str, cell_id: str = "c0") -> tuple[dict[str, str], dict[str, str]]:
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        return (client.hgetall(cell_key(MODEL, cell_id, "record")),
                client.hgetall(cell_key(MODEL, cell_id, "blocks")))
    finally:
        client.close()


def test_index_counts_a_hash_while_any_worker_holds_it() -> None:
    index = CellIndex()
    index.apply("w0", delta({"aa": [1], "bb": [2]}, clear=True))
    index.apply("w1", delta({"aa": [5]}))
    assert sorted(index.take_changes()[0]) == ["aa", "bb"]
    index.apply("w0", delta({"aa": None}))
    assert index.take_changes() == ([], [])  # w1 still holds it
    index.remove_worker("w1")
    assert index.take_changes() == ([], ["aa"])
    index.apply("w0", delta({"cc": [3]}, clear=True))  # a whole state replaces the old
    added, removed = index.take_changes()
    assert (added, removed) == (["cc"], ["bb"])
    index.apply("w2", delta({"dd": [1]}, block_size=32))  # another block size: not indexed
    assert index.all_hashes() == ["cc"]


def test_publishes_record_and_entries_and_renews(redis_url: str) -> None:
    async def run() -> None:
        index = CellIndex()
        index.apply("w0", delta({"aa": [1], "bb": [2]}, clear=True))
        pub = publisher(redis_url, index)
        await pub.publish_once()
        record, blocks = read_cell(redis_url)
        assert pub.generation == 1
        assert CellRecord.from_fields(record) == CellRecord(
            generation=1, block_size=16, num_workers=1, prefill_tokens=7,
            updated_ms=int(record["updated_ms"]))
        assert blocks == {"aa": "1", "bb": "1"}
        index.apply("w0", delta({"aa": None, "cc": [3]}))
        await pub.publish_once()
        assert read_cell(redis_url)[1] == {"bb": "1", "cc": "1"}
        await pub.close()
        assert read_cell(redis_url) == ({}, {})  # a cell that stopped routes nothing

    asyncio.run(run())


def test_restart_waits_for_the_lease_then_replaces_the_old_generation(redis_url: str) -> None:
    async def run() -> None:
        old_index = CellIndex()
        old_index.apply("w0", delta({"aa": [1]}, clear=True))
        old = publisher(redis_url, old_index, lease_ttl_s=1.0, interval_s=0.1)
        await old.publish_once()
        # A restarted scheduler (another owner) while the old lease lives: refused.
        new_index = CellIndex()
        new_index.apply("w0", delta({"bb": [1]}, clear=True))
        new = publisher(redis_url, new_index, lease_ttl_s=1.0, interval_s=0.1)
        await new.publish_once()
        assert new.generation == 0 and read_cell(redis_url)[1] == {"aa": "1"}
        await asyncio.sleep(1.2)  # the old owner died: its lease expires
        await new.publish_once()
        record, blocks = read_cell(redis_url)
        assert new.generation == 2 and record["generation"] == "2"
        assert blocks == {"bb": "2"}
        # The old owner, back from a freeze, cannot write over the new one.
        old_index.apply("w0", delta({"zz": [4]}))
        await old.publish_once()
        assert read_cell(redis_url)[1] == {"bb": "2"}
        await old.close()
        assert read_cell(redis_url)[1] == {"bb": "2"}  # nor delete it
        await new.close()

    asyncio.run(run())


def test_redis_outage_then_a_whole_rewrite() -> None:
    server = EmbeddedRedis()
    port = server.port

    async def run() -> None:
        nonlocal server
        index = CellIndex()
        index.apply("w0", delta({"aa": [1]}, clear=True))
        pub = publisher(server.url, index, timeout_s=0.2)
        await pub.publish_once()
        server.stop()
        index.apply("w0", delta({"bb": [2]}))
        started = time.monotonic()
        await pub.publish_once()  # fails within its timeout, never raises
        assert time.monotonic() - started < 2.0
        assert pub.num_write_errors == 1
        server = EmbeddedRedis(port=port)  # back, empty
        await pub.publish_once()
        record, blocks = read_cell(server.url)
        assert blocks == {"aa": str(pub.generation), "bb": str(pub.generation)}
        assert record["generation"] == str(pub.generation)
        await pub.close()

    try:
        asyncio.run(run())
    finally:
        server.stop()
