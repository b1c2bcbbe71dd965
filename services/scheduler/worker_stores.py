"""Each worker's KV store, and whether its stored prefix cache may be trusted.

A stored prefix index is only worth recovering while the worker's KV memory
still holds those blocks: the scheduler restarted, or the worker's stream
broke and it dialed back, but the worker process (and its KV cache) lived on.
A worker that restarted under the same id has fresh, empty KV memory, and
serving the old index would hand out garbage KV.

So each worker sends a ``kv_cache_id`` (made when it allocated its KV cache)
with its registration, and the store keeps the id of the cache it mirrors.
The stored state is recovered only when the ids match; otherwise it is cleared
first. A session lost while a step was in flight marks its store untrusted:
the worker may or may not have computed that step's blocks.
"""

from __future__ import annotations

import logging

import redis

from services.scheduler.kv_store import InMemoryKVStore, KVStateDelta, KVStore, RedisKVStore

# Field of the store's ``meta`` hash holding the id of the KV cache it mirrors.
# KVCacheManager's clearing commit deletes the whole hash, so a cleared store
# never claims to mirror any cache.
KV_CACHE_ID_FIELD = "kv_cache_id"

logger = logging.getLogger(__name__)


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

    def open(self, model: str, worker_id: str, kv_cache_id: str,
             num_blocks: int, block_size: int) -> KVStore:
        """The worker's store, cleared unless it mirrors the cache ``kv_cache_id`` names.

        Build the Scheduler on it (which recovers what is left), then call
        ``mark_trusted``. An empty ``kv_cache_id`` never matches.
        """
        if self.redis_url is None:
            stored_id, kept = self._memory.pop((model, worker_id), ("", None))
            if kept is None or not kv_cache_id or stored_id != kv_cache_id:
                return InMemoryKVStore()
            return kept
        store = RedisKVStore(self.redis_url, model, worker_id)
        stored_id = store.client.hget(store.meta_key, KV_CACHE_ID_FIELD)
        if not kv_cache_id or stored_id != kv_cache_id:
            store.apply(KVStateDelta(num_blocks, block_size, num_blocks - 1, clear=True))
        return store

    def mark_trusted(self, model: str, worker_id: str, store: KVStore, kv_cache_id: str) -> None:
        """Records that ``store`` now mirrors the KV cache ``kv_cache_id``."""
        if not kv_cache_id:
            return
        if isinstance(store, RedisKVStore):
            store.client.hset(store.meta_key, KV_CACHE_ID_FIELD, kv_cache_id)
        elif isinstance(store, InMemoryKVStore):
            self._memory[(model, worker_id)] = (kv_cache_id, store)

    def release(self, model: str, worker_id: str, store: KVStore, *, trusted: bool) -> None:
        """Leaves the store for a future worker with this id; untrusted ones will be cleared."""
        if isinstance(store, RedisKVStore):
            try:
                if not trusted:
                    store.client.hdel(store.meta_key, KV_CACHE_ID_FIELD)
                store.close()
            except redis.RedisError as e:
                # Failover must go on; a store that cannot be marked untrusted
                # is still cleared unless the same KV cache comes back.
                logger.warning("event=kv_store_release_failed worker=%s error=%r", worker_id, e)
        elif not trusted:
            self._memory.pop((model, worker_id), None)
