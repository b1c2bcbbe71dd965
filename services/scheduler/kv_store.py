"""Mirror of one worker's KV block accounting in a store (Redis, or memory for tests).

The scheduler's in-memory state is authoritative; the store gets each step's
changes in one round trip and serves two readers: recovery (a restarted
scheduler rebuilds its prefix index) and visibility (block usage from any
service). Placement reads the scheduler's own block pools, never the store.
The stores here write synchronously; the scheduler service writes through
``kv_mirror.MirroredKVStore``, which keeps Redis off the step's path.

Redis layout, every key under ``kvmesh:{model}:{worker_id}:``:

- ``meta``         HASH  num_blocks, block_size, num_free_blocks, kv_cache_id
- ``prefix``       HASH  hex block hash -> "id,id,..." (the prefix-hash index)
- ``block_tokens`` HASH  block id -> "tok,tok,..." of each cached block (collision check)
- ``free_seq``     ZSET  cached blocks in the free queue, scored by when they were
                         freed, i.e. in free-queue order
- ``req_blocks``   HASH  request id -> "id,id,..." of each live request
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from services.common.block_hash import BlockHash

K = TypeVar("K")
# Field of the ``meta`` hash naming the worker KV cache the state describes
# (see worker_stores.py). A clear delta deletes the hash, and with it the field.
KV_CACHE_ID_FIELD = "kv_cache_id"


@dataclass(slots=True)
class KVStateDelta:
    """The new value of everything that changed since the last commit.

    In every map, None deletes the entry. Writes are idempotent: applying a
    delta twice gives the same state. ``clear`` drops all stored state first
    (a clear delta carries the whole state). ``step_id`` is the scheduler step
    after whose outputs the delta was taken; ``kv_cache_id``, on a clear
    delta, names the worker KV cache the state describes.
    """

    num_blocks: int
    block_size: int
    num_free_blocks: int
    clear: bool = False
    step_id: int = 0
    kv_cache_id: str | None = None
    prefix_index: dict[str, list[int] | None] = field(default_factory=dict)  # hex hash -> block ids
    block_token_ids: dict[int, list[int] | None] = field(default_factory=dict)  # cached blocks
    free_seq: dict[int, int | None] = field(default_factory=dict)  # cached blocks in the free queue
    req_blocks: dict[str, list[int] | None] = field(default_factory=dict)  # live requests


@dataclass(slots=True)
class KVStateSnapshot:
    """Accounting state in the store's shape; snapshots compare with ==."""

    num_blocks: int
    block_size: int
    num_free_blocks: int
    cached: dict[str, list[int]] = field(default_factory=dict)  # hex hash -> sorted block ids
    req_blocks: dict[str, list[int]] = field(default_factory=dict)
    block_token_ids: dict[int, list[int]] = field(default_factory=dict)  # every cached block
    free_order: list[int] = field(default_factory=list)  # cached free blocks, queue head first

    def cached_blocks_in_eviction_order(self) -> list[tuple[int, BlockHash, tuple[int, ...]]]:
        """(block id, hash, token ids) of each verifiable cached block, next to evict first.

        Free cached blocks keep their free-queue order. Blocks the old requests
        still held come after them, as if each request were freed now (tail
        first), a shared block where its last holder would free it.
        """
        hash_of = {bid: bytes.fromhex(h) for h, ids in self.cached.items() for bid in ids}
        order = dict.fromkeys(bid for bid in self.free_order if bid in hash_of)
        free = set(order)
        for block_ids in self.req_blocks.values():
            for bid in reversed(block_ids):
                if bid in hash_of and bid not in free:
                    order.pop(bid, None)
                    order[bid] = None
        order.update(dict.fromkeys(sorted(hash_of)))  # adds only blocks nobody listed
        # A block without its token ids could not be checked for a collision.
        return [(bid, hash_of[bid], tuple(self.block_token_ids[bid])) for bid in order
                if len(self.block_token_ids.get(bid, ())) == self.block_size]


class KVStore(Protocol):
    @property
    def durable_step_id(self) -> int:
        """The ``step_id`` of the newest delta known to be in the store (-1: none)."""

    @property
    def num_write_errors(self) -> int:
        """Failed writes, cumulative (a mirrored store retries them)."""

    def apply(self, delta: KVStateDelta) -> None:
        """Writes a delta in one round trip (or queues it, for a mirrored store)."""

    def load(self) -> KVStateSnapshot | None:
        """The stored state, or None if nothing is stored."""

    def wants_full_state(self) -> bool:
        """True when the next delta must be a clear one carrying the whole state
        (the store may have lost writes)."""

    def mirror_lag_s(self, now: float) -> float:
        """How long (time.monotonic() seconds) the store has lacked changes it
        was sent; 0 while it mirrors everything."""


def _merge(target: dict[K, list[int]], updates: dict[K, list[int] | None]) -> None:
    for key, value in updates.items():
        if value is None:
            target.pop(key, None)
        else:
            target[key] = list(value)


class InMemoryKVStore:
    """A KVStore in this process: for tests and single-process runs."""

    def __init__(self) -> None:
        self._state: KVStateSnapshot | None = None
        self._free_seq: dict[int, int] = {}
        self.durable_step_id = -1
        self.num_write_errors = 0

    def wants_full_state(self) -> bool:
        return False

    def mirror_lag_s(self, now: float) -> float:
        return 0.0

    def apply(self, delta: KVStateDelta) -> None:
        if delta.clear or self._state is None:
            self._state = KVStateSnapshot(delta.num_blocks, delta.block_size, 0)
            self._free_seq = {}
        state = self._state
        state.num_blocks, state.block_size = delta.num_blocks, delta.block_size
        state.num_free_blocks = delta.num_free_blocks
        _merge(state.cached, delta.prefix_index)
        _merge(state.block_token_ids, delta.block_token_ids)
        _merge(state.req_blocks, delta.req_blocks)
        for block_id, seq in delta.free_seq.items():
            if seq is None:
                self._free_seq.pop(block_id, None)
            else:
                self._free_seq[block_id] = seq
        self.durable_step_id = delta.step_id

    def load(self) -> KVStateSnapshot | None:
        if self._state is None:
            return None
        s = self._state
        return KVStateSnapshot(
            s.num_blocks, s.block_size, s.num_free_blocks,
            cached={h: list(ids) for h, ids in s.cached.items()},
            req_blocks={r: list(ids) for r, ids in s.req_blocks.items()},
            block_token_ids={b: list(t) for b, t in s.block_token_ids.items()},
            free_order=sorted(self._free_seq, key=self._free_seq.__getitem__),
        )


def _encode_ids(ids: list[int]) -> str:
    return ",".join(map(str, ids))


def _decode_ids(text: str) -> list[int]:
    return [int(x) for x in text.split(",")] if text else []


class RedisKVStore:
    """A KVStore in Redis; every call is one round trip (a MULTI/EXEC pipeline,
    so readers never see half a step) and raises redis.RedisError on failure.

    ``timeout_s`` bounds every call (None: redis-py's default, no timeout);
    with it, a failed command is not retried, so the caller learns of every
    broken connection (the server may have restarted empty).
    """

    def __init__(self, url: str, model: str, worker_id: str, *,
                 timeout_s: float | None = None) -> None:
        options = {} if timeout_s is None else dict(
            socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0), retry_on_error=[])
        self.client = redis.Redis.from_url(url, decode_responses=True, **options)
        self.durable_step_id = -1
        prefix = f"kvmesh:{model}:{worker_id}:"
        self.meta_key = prefix + "meta"
        self.prefix_key = prefix + "prefix"
        self.block_tokens_key = prefix + "block_tokens"
        self.free_seq_key = prefix + "free_seq"
        self.req_blocks_key = prefix + "req_blocks"
        # Synchronous: a write either lands or raises (MirroredKVStore counts).
        self.num_write_errors = 0

    def mirror_lag_s(self, now: float) -> float:
        return 0.0

    def _all_keys(self) -> list[str]:
        return [self.meta_key, self.prefix_key, self.block_tokens_key,
                self.free_seq_key, self.req_blocks_key]

    def wants_full_state(self) -> bool:
        return False

    def apply(self, delta: KVStateDelta) -> None:
        pipe = self.client.pipeline(transaction=True)
        if delta.clear:
            pipe.delete(*self._all_keys())
        meta = {"num_blocks": delta.num_blocks, "block_size": delta.block_size,
                "num_free_blocks": delta.num_free_blocks}
        if delta.kv_cache_id:
            meta[KV_CACHE_ID_FIELD] = delta.kv_cache_id
        pipe.hset(self.meta_key, mapping=meta)
        self._write_lists(pipe, self.prefix_key, delta.prefix_index)
        self._write_lists(pipe, self.block_tokens_key, delta.block_token_ids)
        self._write_lists(pipe, self.req_blocks_key, delta.req_blocks)
        seqs = {bid: seq for bid, seq in delta.free_seq.items() if seq is not None}
        gone = [bid for bid, seq in delta.free_seq.items() if seq is None]
        if seqs:
            pipe.zadd(self.free_seq_key, seqs)
        if gone:
            pipe.zrem(self.free_seq_key, *gone)
        pipe.execute()
        self.durable_step_id = delta.step_id

    def read_kv_cache_id(self) -> str | None:
        """The id of the worker KV cache the stored state describes, if any."""
        return self.client.hget(self.meta_key, KV_CACHE_ID_FIELD)

    @staticmethod
    def _write_lists(pipe: redis.client.Pipeline, key: str,
                     updates: dict[str, list[int] | None] | dict[int, list[int] | None]) -> None:
        values = {k: _encode_ids(v) for k, v in updates.items() if v is not None}
        deleted = [k for k, v in updates.items() if v is None]
        if values:
            pipe.hset(key, mapping=values)
        if deleted:
            pipe.hdel(key, *deleted)

    def load(self) -> KVStateSnapshot | None:
        pipe = self.client.pipeline(transaction=True)
        pipe.hgetall(self.meta_key)
        pipe.hgetall(self.prefix_key)
        pipe.hgetall(self.block_tokens_key)
        pipe.zrange(self.free_seq_key, 0, -1)
        pipe.hgetall(self.req_blocks_key)
        meta, prefix, block_tokens, free_order, req_blocks = pipe.execute()
        if not meta:
            return None
        return KVStateSnapshot(
            int(meta["num_blocks"]), int(meta["block_size"]), int(meta["num_free_blocks"]),
            cached={h: _decode_ids(ids) for h, ids in prefix.items()},
            req_blocks={r: _decode_ids(ids) for r, ids in req_blocks.items()},
            block_token_ids={int(b): _decode_ids(t) for b, t in block_tokens.items()},
            free_order=[int(b) for b in free_order],
        )

    def close(self) -> None:
        self.client.close()
