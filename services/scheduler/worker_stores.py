"""Each worker's KV store, and which of its stored prefix cache may be trusted.

A stored prefix index is only worth recovering while the worker's KV memory
still holds those blocks: the scheduler restarted, or the worker's stream
broke and it dialed back, but the worker process (and its KV cache) lived on.
A worker that restarted under the same id has fresh, empty KV memory, and
serving the old index would hand out garbage KV.

So each worker sends a ``kv_cache_id`` (made when it allocated its KV cache)
with its registration, and the store keeps the id of the cache it mirrors
(written with every whole state, see kv_mirror.py). The stored state is
recovered only when the ids match. Within that state, the store only ever
indexes blocks whose step the worker had computed (deltas are committed after
the worker's answer), and the worker reports the blocks it may have written
since the mirror last became durable (``WorkerRegistration.dirty_block_ids``):
those are left out of the recovery, so no block is served whose KV changed
after it was indexed — whenever the scheduler died or a write was lost.

Opening reads Redis, so ``open`` runs on a thread; an unreachable Redis never
refuses a worker: it starts with an empty prefix cache and its mirror catches
up once Redis answers.
"""

from __future__ import annotations

import logging

import redis

from services.scheduler.kv_mirror import MirroredKVStore
from services.scheduler.kv_store import InMemoryKVStore, KVStore, RedisKVStore

logger = logging.getLogger(__name__)

# Redis calls made for a worker's mirror give up after this long.
REDIS_TIMEOUT_S = 1.0


class WorkerStores:
    """Opens and releases the KV store of each worker, namespaced by model and worker id.

    ``redis_url`` None keeps each worker's mirror in this process
    (InMemoryKVStore), so a worker that dials back to the same scheduler still
    finds its prefix cache. ``timeout_s`` bounds each Redis call.
    """

    def __init__(self, redis_url: str | None, timeout_s: float = REDIS_TIMEOUT_S) -> None:
        self.redis_url = redis_url
        self.timeout_s = timeout_s
        # (model, worker_id) -> (kv_cache_id, store), in-memory mode only.
        self._memory: dict[tuple[str, str], tuple[str, InMemoryKVStore]] = {}
        # The live mirror of each worker, so a re-registration waits for the old
        # writer to stop before it reads (no stale write lands after the new state).
        self._mirrors: dict[tuple[str, str], MirroredKVStore] = {}

    def open(self, model: str, worker_id: str, kv_cache_id: str) -> KVStore:
        """The worker's store; its ``load()`` gives the stored state only if it
        mirrors the cache ``kv_cache_id`` names (an empty id never matches).

        Blocks on Redis for up to a few timeouts: call it on a thread.
        """
        if self.redis_url is None:
            return self._open_in_memory(model, worker_id, kv_cache_id)
        previous = self._mirrors.pop((model, worker_id), None)
        if previous is not None and not previous.join():
            logger.warning("event=kv_mirror_writer_stuck worker=%s", worker_id)
        store = RedisKVStore(self.redis_url, model, worker_id, timeout_s=self.timeout_s)
        try:
            matches = bool(kv_cache_id) and store.read_kv_cache_id() == kv_cache_id
            snapshot = store.load() if matches else None
        except redis.RedisError as e:
            logger.warning("event=kv_store_unreachable worker=%s error=%r", worker_id, e)
            mirror = MirroredKVStore(store, worker_id, kv_cache_id, None, reachable=False)
        else:
            mirror = MirroredKVStore(store, worker_id, kv_cache_id, snapshot)
        self._mirrors[(model, worker_id)] = mirror
        return mirror

    def _open_in_memory(self, model: str, worker_id: str, kv_cache_id: str) -> KVStore:
        stored_id, kept = self._memory.pop((model, worker_id), ("", None))
        store = kept if kept is not None and kv_cache_id and stored_id == kv_cache_id else None
        store = store or InMemoryKVStore()
        if kv_cache_id:
            self._memory[(model, worker_id)] = (kv_cache_id, store)
        return store

    def release(self, store: KVStore) -> None:
        """Leaves the store for a future worker with the same id and KV cache.
        Never blocks: a mirrored store finishes its last write on its own thread."""
        if isinstance(store, MirroredKVStore):
            store.close()
