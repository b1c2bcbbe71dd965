"""This scheduler's cell in Redis: lease, generation, load summary, prefix entries.

Frontends route new requests between cells by these (see
``services/common/cell_index.py`` for the layout). The publisher runs as an
asyncio task on the scheduler's loop and writes every ``interval_s`` in one
round trip, a Lua script that checks the lease first, so only the owner
ever writes the cell's keys:

- at start (and whenever the lease was lost: Redis restarted, or this
  process was frozen past its TTL) it takes the lease once the previous
  owner's record has expired, bumps the generation, drops the old entries and
  writes every entry it has;
- afterwards it renews the lease with the load summary and the entries that
  changed since the last write; after a failed write it rewrites them all
  (a write may have been lost).

Redis is never on a step's path: the steps only record entry changes in
``CellIndex`` (in memory); a slow or dead Redis delays the index, not serving.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import Counter
from collections.abc import Callable

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from services.common.cell_index import CellRecord, cell_key
from services.scheduler.kv_store import KVStateDelta

logger = logging.getLogger(__name__)

# A publish in progress when closing gets this long to end (every call times out).
_CLOSE_TIMEOUT_S = 2.0

# Returns: the generation written; -1 another owner holds the lease; -2 the
# lease was lost (the record is gone), start again.
# KEYS: record, blocks, generation.
# ARGV: owner, ttl_ms, mode (start | full | update), then n and n field/value
# pairs of the record, then n and n hashes to add, then n and n hashes to drop.
_PUBLISH_SCRIPT = """
local record, blocks = KEYS[1], KEYS[2]
local owner = redis.call('HGET', record, 'owner')
if owner and owner ~= ARGV[1] then return -1 end
local mode = ARGV[3]
local gen
if mode == 'start' then
  gen = redis.call('INCR', KEYS[3])
  redis.call('DEL', blocks)
elseif not owner then
  return -2
else
  gen = tonumber(redis.call('HGET', record, 'generation'))
  if mode == 'full' then redis.call('DEL', blocks) end
end
local i = 4
local n = tonumber(ARGV[i])
local values = {'owner', ARGV[1], 'generation', gen}
for j = 1, n do
  values[#values + 1] = ARGV[i + 2 * j - 1]
  values[#values + 1] = ARGV[i + 2 * j]
end
redis.call('HSET', record, unpack(values))
i = i + 2 * n + 1
n = tonumber(ARGV[i])
local chunk = {}
for j = 1, n do
  chunk[#chunk + 1] = ARGV[i + j]
  chunk[#chunk + 1] = gen
  if #chunk >= 2000 or j == n then
    redis.call('HSET', blocks, unpack(chunk))
    chunk = {}
  end
end
i = i + n + 1
n = tonumber(ARGV[i])
for j = 1, n, 1000 do
  redis.call('HDEL', blocks, unpack(ARGV, i + j, math.min(i + j + 999, i + n)))
end
redis.call('PEXPIRE', record, ARGV[2])
redis.call('PEXPIRE', blocks, ARGV[2])
return gen
"""

# Deletes the cell's keys if this owner still holds the lease (a clean stop).
_RELEASE_SCRIPT = """
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  redis.call('DEL', KEYS[1], KEYS[2])
  return 1
end
return 0
"""


class CellIndex:
    """Which block hashes the cell holds: a hash is in while any worker holds it.

    Fed with each worker's KV deltas (``apply``, on the scheduler's loop);
    ``take_changes`` hands the publisher what entered and left since last time.
    Only workers of the cell's block size (the first worker's) count: entries
    are looked up by hashes of that block size.
    """

    def __init__(self) -> None:
        self.block_size = 0
        self._by_worker: dict[str, set[str]] = {}
        self._count: Counter[str] = Counter()
        self._added: set[str] = set()
        self._removed: set[str] = set()

    def apply(self, worker_id: str, delta: KVStateDelta) -> None:
        if self.block_size == 0:
            self.block_size = delta.block_size
        if delta.block_size != self.block_size:
            return
        held = self._by_worker.setdefault(worker_id, set())
        if delta.clear:
            for block_hash in list(held):
                if delta.prefix_index.get(block_hash) is None:
                    self._drop(held, block_hash)
        for block_hash, block_ids in delta.prefix_index.items():
            if block_ids is None:
                self._drop(held, block_hash)
            elif block_hash not in held:
                held.add(block_hash)
                self._count[block_hash] += 1
                if self._count[block_hash] == 1:
                    self._added.add(block_hash)
                    self._removed.discard(block_hash)

    def remove_worker(self, worker_id: str) -> None:
        held = self._by_worker.pop(worker_id, set())
        for block_hash in list(held):
            self._drop(held, block_hash)

    def _drop(self, held: set[str], block_hash: str) -> None:
        if block_hash not in held:
            return
        held.discard(block_hash)
        self._count[block_hash] -= 1
        if self._count[block_hash] == 0:
            del self._count[block_hash]
            self._removed.add(block_hash)
            self._added.discard(block_hash)

    def take_changes(self) -> tuple[list[str], list[str]]:
        """(entered, left) since the last call."""
        added, removed = list(self._added), list(self._removed)
        self._added.clear()
        self._removed.clear()
        return added, removed

    def all_hashes(self) -> list[str]:
        """Every hash the cell holds (also clears the pending changes)."""
        self.take_changes()
        return list(self._count)


class CellPublisher:
    """Publishes the cell ``cell_id`` in Redis at ``redis_url`` (see the module docstring).

    ``index`` is the cell's prefix entries, fed by the scheduling loops.
    ``model`` and ``record`` are read on the loop before each write: the
    model namespaces the keys (None: no worker yet, nothing to publish) and
    ``record()`` gives the load summary. ``generation`` is the one written
    last (0 before the first write).
    """

    def __init__(self, redis_url: str, cell_id: str, index: CellIndex,
                 model: Callable[[], str | None], record: Callable[[], CellRecord], *,
                 lease_ttl_s: float = 3.0,
                 interval_s: float = 0.1, timeout_s: float = 0.5) -> None:
        if not 0 < interval_s < lease_ttl_s:
            raise ValueError(f"interval_s is {interval_s}, must be in (0, lease_ttl_s)")
        self.cell_id = cell_id
        self.index = index
        self.generation = 0
        self.num_write_errors = 0
        self._model = model
        self._record = record
        self._owner = uuid.uuid4().hex
        self._ttl_ms = int(lease_ttl_s * 1000)
        self._interval_s = interval_s
        # No retries: a failed write is redone whole by the next one anyway.
        self._client = aioredis.Redis.from_url(
            redis_url, decode_responses=True, socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0), retry_on_error=[])
        self._publish = self._client.register_script(_PUBLISH_SCRIPT)
        self._release = self._client.register_script(_RELEASE_SCRIPT)
        self._mode = "start"  # what the next write must be: start, full or update
        self._keys: list[str] | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"cell-publisher-{self.cell_id}")

    async def close(self) -> None:
        """Stops publishing and, if it still holds the lease, deletes the cell's keys:
        a cell that stopped routes nothing."""
        self._closing = True
        if self._task is not None:
            # The flag ends the loop even where redis-py swallowed the cancellation
            # of a call in progress.
            self._task.cancel()
            await asyncio.wait((self._task,), timeout=_CLOSE_TIMEOUT_S)
            self._task = None
        if self._keys is not None:
            try:
                await self._release(keys=self._keys[:2], args=[self._owner])
            except redis.RedisError as e:
                logger.warning("event=cell_release_failed cell=%s error=%r", self.cell_id, e)
        await self._client.aclose()

    async def _run(self) -> None:
        while not self._closing:
            await self.publish_once()
            await asyncio.sleep(self._interval_s)

    async def publish_once(self) -> None:
        """One write (or nothing before the first worker); never raises for Redis."""
        model = self._model()
        if model is None:
            return
        self._keys = [cell_key(model, self.cell_id, name)
                      for name in ("record", "blocks", "generation")]
        mode = self._mode
        if mode == "update":
            added, removed = self.index.take_changes()
        else:
            added, removed = self.index.all_hashes(), []
        record = self._record().to_fields()
        del record["generation"]  # the script writes the one it holds
        args: list[str | int] = [self._owner, self._ttl_ms, mode, len(record)]
        for name, value in record.items():
            args += [name, value]
        args += [len(added), *added, len(removed), *removed]
        try:
            generation = int(await self._publish(keys=self._keys, args=args))
        except redis.RedisError as e:
            self._on_error(e)
            return
        if generation == -1:
            if mode == "start" and self.generation == 0:
                logger.info("event=cell_lease_held cell=%s", self.cell_id)
            self._mode = "start"
        elif generation == -2:
            logger.warning("event=cell_lease_lost cell=%s generation=%d", self.cell_id,
                           self.generation)
            self._mode = "start"
            await self.publish_once()  # take it again at once, with every entry
        else:
            if mode == "start":
                logger.info("event=cell_published cell=%s generation=%d num_entries=%d",
                            self.cell_id, generation, len(added))
            self.generation = generation
            self._mode = "update"

    def _on_error(self, error: redis.RedisError) -> None:
        self.num_write_errors += 1
        if self._mode == "update":
            logger.warning("event=cell_publish_failed cell=%s error=%r", self.cell_id, error)
            self._mode = "full"  # the changes taken for this write are lost
