"""The frontend's reader of the cell index in Redis (layout: services/common/cell_index.py).

One lookup is one pipelined round trip: every candidate cell's record and
its entries for the request's block hashes. Redis is never needed to serve:
a lookup that fails or takes longer than ``timeout_s`` returns None (the
caller routes by load), and Redis is then left alone for ``retry_after_s``
so a dead or slow server costs one timeout, not one per request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from services.common.block_hash import hash_block_tokens
from services.common.cell_index import CellRecord, cell_key

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CellLookup:
    """A cell as the index shows it: its live record (None: no lease, no
    entries to trust) and how many leading blocks of the request it holds."""

    record: CellRecord | None
    num_hit_blocks: int


def prompt_block_hashes(token_ids: Sequence[int], block_size: int,
                        cache_salt: str | None) -> list[str]:
    """Hex hashes of the full blocks a prefix hit may cover, as the scheduler
    hashes them (the salt keys the first block; a hit leaves the last token)."""
    hashes: list[str] = []
    parent = None
    num_blocks = (len(token_ids) - 1) // block_size
    for i in range(num_blocks):
        extra_keys = (cache_salt,) if i == 0 and cache_salt is not None else None
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size],
                                   extra_keys)
        hashes.append(parent.hex())
    return hashes


class PrefixIndexReader:
    """Reads cells' records and prefix entries from Redis at ``url``."""

    def __init__(self, url: str, *, timeout_s: float = 0.1, retry_after_s: float = 1.0) -> None:
        self._client = aioredis.Redis.from_url(
            url, decode_responses=True, socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0), retry_on_error=[])
        self._timeout_s = timeout_s
        self._retry_after_s = retry_after_s
        self._unavailable_until = 0.0
        self.num_errors = 0

    @property
    def available(self) -> bool:
        """False while a recent failure keeps the reader off Redis."""
        return time.monotonic() >= self._unavailable_until

    async def lookup(self, model: str,
                     queries: Sequence[tuple[str, Sequence[str]]]) -> dict[str, CellLookup] | None:
        """For each (cell id, hex block hashes): its record and leading hits.

        None when Redis is unavailable (failed, slower than ``timeout_s``, or
        failed less than ``retry_after_s`` ago).
        """
        if not self.available:
            return None
        pipe = self._client.pipeline(transaction=False)
        for cell_id, hashes in queries:
            pipe.hgetall(cell_key(model, cell_id, "record"))
            if hashes:
                pipe.hmget(cell_key(model, cell_id, "blocks"), list(hashes))
        try:
            replies = await asyncio.wait_for(pipe.execute(), self._timeout_s)
        except (redis.RedisError, OSError, TimeoutError) as e:
            self._on_error(e)
            return None
        result: dict[str, CellLookup] = {}
        position = 0
        for cell_id, hashes in queries:
            record = CellRecord.from_fields(replies[position])
            position += 1
            entries: list[str | None] = []
            if hashes:
                entries = replies[position]
                position += 1
            result[cell_id] = CellLookup(record, _leading_hits(entries, record))
        return result

    def _on_error(self, error: BaseException) -> None:
        self.num_errors += 1
        if self.available:
            logger.warning("event=prefix_index_unavailable error=%r retry_in_s=%.1f",
                           error, self._retry_after_s)
        self._unavailable_until = time.monotonic() + self._retry_after_s

    async def close(self) -> None:
        await self._client.aclose()


def _leading_hits(entries: Sequence[str | None], record: CellRecord | None) -> int:
    """Leading entries written by the record's generation (none without a record)."""
    if record is None:
        return 0
    generation = str(record.generation)
    count = 0
    for entry in entries:
        if entry != generation:
            break
        count += 1
    return count
