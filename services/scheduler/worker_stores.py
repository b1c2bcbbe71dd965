"""Each worker's KV store, and whether its stored prefix cache may be trusted.

A stored prefix index is only worth recovering while the worker's KV memory
still holds those blocks: the scheduler restarted, or the worker's stream
broke and it dialed back, but the worker process (and its KV cache) lived on.
A worker that restarted under the same id has fresh, empty KV memory, and
serving the old index would hand out garbage KV.

So each worker sends a ``kv_cache_id`` (made when it allocated its KV cache)
with its registration, and the store keeps the id of the cache it mirrors
(written with every whole state, see kv_mirror.py). The stored state is
recovered only when the ids match. A session lost while a step was in flight
marks its store untrusted: the worker may or may not have computed that
step's blocks.

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
    finds its prefix cache.
    """

    def __init__(self, redis_url: str | None) -> None:
        self.redis_url = redis_url
        # (model, worker_id) -> (kv_cache_id, store), in-memory mode only.
        self._memory: dict[tuple[str, str], tuple[str, InMemoryKVStore]] = {}

    def open(self, model: str, worker_id: str, kv_cache_id: str) -> KVStore:
        """The worker's store; its ``load()`` gives the stored state only if it
        mirrors the cache ``kv_cache_id`` names (an empty id never matches).

        Blocks on Redis for up to a few timeouts: call it on a thread.
        """
        if self.redis_url is None:
            return self._open_in_memory(model, worker_id, kv_cache_id)
        store = RedisKVStore(self.redis_url, model, worker_id, timeout_s=REDIS_TIMEOUT_S)
        try:
            matches = bool(kv_cache_id) and store.read_kv_cache_id() == kv_cache_id
            snapshot = store.load() if matches else None
        except redis.RedisError as e:
            logger.warning("event=kv_store_unreachable worker=%s error=%r", worker_id, e)
            return MirroredKVStore(store, worker_id, kv_cache_id, None, reachable=False)
        return MirroredKVStore(store, worker_id, kv_cache_id, snapshot)

    def _open_in_memory(self, model: str, worker_id: str, kv_cache_id: str) -> KVStore:
        stored_id, kept = self._memory.pop((model, worker_id), ("", None))
        store = kept if kept is not None and kv_cache_id and stored_id == kv_cache_id else None
        store = store or InMemoryKVStore()
        if kv_cache_id:
            self._memory[(model, worker_id)] = (kv_cache_id, store)
        return store

    def release(self, model: str, worker_id: str, store: KVStore, *, trusted: bool) -> None:
        """Leaves the store for a future worker with this id; untrusted ones will not
        be recovered. Never blocks: a mirrored store finishes on its own thread."""
        if isinstance(store, MirroredKVStore):
            store.close(trusted=trusted)
        elif not trusted:
            self._memory.pop((model, worker_id), None)
