"""MirroredKVStore: Redis kept off the scheduling loop's path.

The scheduler's in-memory state is authoritative and serving never waits on
Redis. ``apply`` only merges a delta into the one waiting to be written and
wakes a writer thread, so a step costs the same whether Redis is fast, slow,
stopped or gone. The writer applies the merged delta with a timeout; while
Redis fails it retries with backoff and the mirror is *behind*. Any failure
may have lost a write, or Redis may have restarted empty, so the mirror then
asks for the whole state (``wants_full_state``) and the next write is a clear
delta carrying it, with later deltas merged on top.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import redis

from services.scheduler.kv_store import KVStateDelta, KVStateSnapshot, RedisKVStore

logger = logging.getLogger(__name__)

_MIN_BACKOFF_S = 0.05
_MAX_BACKOFF_S = 2.0
# Every Redis call times out after at most a connect plus a socket timeout.
_CLOSE_TIMEOUT_S = 3.0


def merge_deltas(older: KVStateDelta, newer: KVStateDelta) -> KVStateDelta:
    """One delta with the effect of applying ``older`` then ``newer``."""
    if newer.clear:
        return newer
    return replace(
        older, num_blocks=newer.num_blocks, block_size=newer.block_size,
        num_free_blocks=newer.num_free_blocks, step_id=newer.step_id,
        prefix_index={**older.prefix_index, **newer.prefix_index},
        block_token_ids={**older.block_token_ids, **newer.block_token_ids},
        free_seq={**older.free_seq, **newer.free_seq},
        req_blocks={**older.req_blocks, **newer.req_blocks},
    )


class MirroredKVStore:
    """A KVStore that writes to Redis from a background thread (see the module docstring).

    ``snapshot`` is what the store held when the worker registered (read on a
    thread before the scheduler is built), returned once by ``load()``.
    ``kv_cache_id`` names the worker's KV cache; every clear delta writes it,
    so the stored state says which cache it describes. ``on_apply``, when
    set, sees every delta first, on the owner's thread (the cell index).
    """

    def __init__(self, store: RedisKVStore, worker_id: str, kv_cache_id: str,
                 snapshot: KVStateSnapshot | None, *, reachable: bool = True) -> None:
        self.store = store
        self.worker_id = worker_id
        self.kv_cache_id = kv_cache_id
        self._snapshot = snapshot
        self.on_apply: Callable[[KVStateDelta], None] | None = None
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._pending: KVStateDelta | None = None
        self._want_full = not reachable
        self._closing = False
        self.durable_step_id = -1
        self.is_behind = not reachable
        self.num_write_errors = 0
        # Since when the mirror has lacked changes it was sent (None: in sync).
        self._behind_since: float | None = None if reachable else time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"kv-mirror-{worker_id}",
                                        daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ owner side

    def load(self) -> KVStateSnapshot | None:
        snapshot, self._snapshot = self._snapshot, None
        return snapshot

    def wants_full_state(self) -> bool:
        return self._want_full

    def mirror_lag_s(self, now: float) -> float:
        behind_since = self._behind_since
        return 0.0 if behind_since is None else now - behind_since

    def apply(self, delta: KVStateDelta) -> None:
        """Queues ``delta`` (merged with what is still unwritten); never blocks on Redis."""
        if self.on_apply is not None:
            self.on_apply(delta)
        if delta.clear:
            delta = replace(delta, kv_cache_id=self.kv_cache_id or None)
        with self._work:
            if delta.clear:
                self._want_full = False
            self._pending = delta if self._pending is None else merge_deltas(self._pending, delta)
            self._work.notify()

    def close(self) -> None:
        """Writes what is pending (one try) and stops the writer. Returns at once;
        ``join`` waits for the thread, which every Redis timeout bounds."""
        with self._work:
            self._closing = True
            self._work.notify()

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Waits until nothing is pending (tests, shutdown); False on timeout."""
        with self._work:
            return self._work.wait_for(lambda: self._pending is None and not self.is_behind,
                                       timeout_s)

    # ------------------------------------------------------------ writer thread

    def _run(self) -> None:
        backoff_s = _MIN_BACKOFF_S
        while True:
            with self._work:
                self._work.wait_for(lambda: self._pending is not None or self._closing)
                delta, self._pending = self._pending, None
                closing = self._closing
                if delta is not None and self._want_full and not delta.clear:
                    delta = None  # superseded by the whole state the owner will send
            if delta is not None and not self._write(delta):
                if closing:
                    break  # Redis is down at shutdown: the next scheduler resyncs
                self._sleep(backoff_s)
                backoff_s = min(backoff_s * 2, _MAX_BACKOFF_S)
                continue
            backoff_s = _MIN_BACKOFF_S
            if closing:
                break
        self.store.close()

    def _write(self, delta: KVStateDelta) -> bool:
        try:
            self.store.apply(delta)
        except redis.RedisError as e:
            self._on_failure(delta, e)
            return False
        with self._work:
            self.durable_step_id = delta.step_id
            if self.is_behind and self._pending is None and not self._want_full:
                self.is_behind = False
                self._behind_since = None
                logger.info("event=kv_mirror_resynced worker=%s step_id=%d",
                            self.worker_id, delta.step_id)
            self._work.notify_all()
        return True

    def _on_failure(self, delta: KVStateDelta, error: redis.RedisError) -> None:
        with self._work:
            self.num_write_errors += 1
            if not self.is_behind:
                logger.warning("event=kv_mirror_behind worker=%s error=%r", self.worker_id,
                               error)
                self._behind_since = time.monotonic()
            self.is_behind = True
            if delta.clear:
                # A whole state is still whole: keep it, with newer deltas on top.
                self._pending = delta if self._pending is None else merge_deltas(
                    delta, self._pending)
            elif self._pending is None or not self._pending.clear:
                self._want_full = True  # a write may be lost: only a whole state repairs it

    def _sleep(self, seconds: float) -> None:
        with self._work:
            self._work.wait_for(lambda: self._closing, seconds)

    def join(self, timeout_s: float = _CLOSE_TIMEOUT_S) -> bool:
        """Waits for the writer thread to end (after ``close``); False on timeout."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()
