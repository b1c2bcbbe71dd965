"""The frontend's reader of the cell index in Redis (layout: services/common/cell_index.py).

One lookup is one round trip: a Lua script reads every candidate cell's
record and counts, inside Redis, the leading block hashes of the request the
cell holds under its record's generation, so the request's hashes are sent
once and only numbers come back (hashes sent per cell and parsed per cell
cost the frontend a millisecond at four cells). Redis is never needed to serve:
a lookup that fails or takes longer than ``timeout_s`` returns None (the
caller routes by load), and Redis is then left alone for ``retry_after_s``
so a dead or slow server costs one timeout, not one per request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from services.common.block_hash import hash_block_tokens
from services.common.cell_index import CellRecord, cell_key

logger = logging.getLogger(__name__)

RECORD_FIELDS = tuple(f.name for f in fields(CellRecord))
assert RECORD_FIELDS[0] == "generation"  # the script compares entries with it

# KEYS: each cell's record key, then its blocks key. ARGV[1]: the request's
# block hashes in prompt order, joined (one argument: packing one argument per
# hash per call cost the frontend more than Redis took); ARGV[2]: the width of
# one. Returns, per cell, its record's values (nil where missing), then how
# many leading hashes it holds under the record's generation. Hashes are read
# in growing chunks, so a cell without the prefix stops after a few.
_LOOKUP_SCRIPT = """
local fields = {%s}
local joined, width = ARGV[1], tonumber(ARGV[2])
local num_hashes = #joined / width
local result = {}
for i = 1, #KEYS, 2 do
  local values = redis.call('HMGET', KEYS[i], unpack(fields))
  local generation = values[1]
  local hits, chunk = 0, 4
  while generation and hits < num_hashes do
    local wanted = {}
    for j = hits + 1, math.min(hits + chunk, num_hashes) do
      wanted[#wanted + 1] = string.sub(joined, (j - 1) * width + 1, j * width)
    end
    local entries = redis.call('HMGET', KEYS[i + 1], unpack(wanted))
    local held = 0
    for j = 1, #entries do
      if entries[j] ~= generation then break end
      held = j
    end
    hits = hits + held
    if held < #entries then break end
    chunk = math.min(chunk * 4, 256)
  end
  values[#fields + 1] = hits
  result[#result + 1] = values
end
return result
""" % ", ".join(f"'{name}'" for name in RECORD_FIELDS)


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
        self._script = self._client.register_script(_LOOKUP_SCRIPT)
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
        # Cells of one block size share the request's hashes: one script call
        # each (one in practice), all in flight together.
        groups: dict[tuple[str, ...], list[str]] = {}
        for cell_id, hashes in queries:
            groups.setdefault(tuple(hashes), []).append(cell_id)
        calls = [self._script(keys=[cell_key(model, cell_id, name) for cell_id in cell_ids
                                    for name in ("record", "blocks")],
                              args=["".join(hashes), _hash_width(hashes)])
                 for hashes, cell_ids in groups.items()]
        try:
            async with asyncio.timeout(self._timeout_s):  # (no task, unlike wait_for)
                replies = [await calls[0]] if len(calls) == 1 else await asyncio.gather(*calls)
        except (redis.RedisError, OSError, TimeoutError) as e:
            self._on_error(e)
            return None
        result: dict[str, CellLookup] = {}
        for cell_ids, reply in zip(groups.values(), replies):
            for cell_id, values in zip(cell_ids, reply):
                record = CellRecord.from_fields(
                    {name: value for name, value in zip(RECORD_FIELDS, values)
                     if value is not None})
                result[cell_id] = CellLookup(record, int(values[-1]) if record else 0)
        return result

    def _on_error(self, error: BaseException) -> None:
        self.num_errors += 1
        if self.available:
            logger.warning("event=prefix_index_unavailable error=%r retry_in_s=%.1f",
                           error, self._retry_after_s)
        self._unavailable_until = time.monotonic() + self._retry_after_s

    async def close(self) -> None:
        await self._client.aclose()


def _hash_width(hashes: Sequence[str]) -> int:
    """The one length of every hash (the script splits them by it)."""
    widths = {len(h) for h in hashes} or {1}
    if len(widths) != 1:
        raise ValueError(f"block hashes of several lengths {sorted(widths)}: one expected")
    return widths.pop()
