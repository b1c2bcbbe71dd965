"""Block hashing, the KV block handle and the free-block queue (vLLM V1 names).

Block hashes must agree across processes (frontends, schedulers and Redis all
compare them), so they are sha256 over a canonical byte encoding, never
Python's salted ``hash()`` or pickle.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.scheduler.request import Request

BlockHash = bytes

# Parent of every first block: a fixed value, the same in every process.
NONE_HASH: BlockHash = hashlib.sha256(b"kvmesh").digest()

_INT64 = struct.Struct("<q")


def _encode_extra_key(key: object) -> bytes:
    """Type tag + length + payload, so that ("ab",) and ("a", "b") differ."""
    if isinstance(key, bool) or not isinstance(key, (int, str, bytes)):
        raise TypeError(
            f"extra key {key!r} has type {type(key).__name__}; allowed: int, str, bytes")
    if isinstance(key, int):
        return b"i" + _INT64.pack(key)
    payload = key.encode() if isinstance(key, str) else key
    return (b"s" if isinstance(key, str) else b"b") + _INT64.pack(len(payload)) + payload


def hash_block_tokens(
    parent_block_hash: BlockHash | None,
    curr_block_token_ids: Sequence[int],
    extra_keys: tuple | None = None,
) -> BlockHash:
    """sha256(parent hash, little-endian int64 token ids, extra keys).

    ``parent_block_hash`` None means "first block" and hashes as NONE_HASH, so
    the hash of a block depends on every token before it.
    """
    h = hashlib.sha256(parent_block_hash if parent_block_hash is not None else NONE_HASH)
    h.update(_INT64.pack(len(curr_block_token_ids)))
    h.update(struct.pack(f"<{len(curr_block_token_ids)}q", *curr_block_token_ids))
    for key in extra_keys or ():
        h.update(_encode_extra_key(key))
    return h.digest()


def get_request_block_hasher(block_size: int) -> Callable[[Request], list[BlockHash]]:
    """Returns f(request) -> hashes of its FULL blocks not yet in ``request.block_hashes``.

    ``cache_salt`` is an extra key of the first block only: every later hash
    chains through it, so the salt isolates the whole sequence.
    """
    if block_size < 1:
        raise ValueError(f"block_size is {block_size}, must be >= 1")

    def request_block_hasher(request: Request) -> list[BlockHash]:
        token_ids = request.all_token_ids
        start = len(request.block_hashes) * block_size
        parent = request.block_hashes[-1] if request.block_hashes else None
        new_hashes: list[BlockHash] = []
        while start + block_size <= len(token_ids):
            salted = start == 0 and request.cache_salt is not None
            extra_keys = (request.cache_salt,) if salted else None
            parent = hash_block_tokens(parent, token_ids[start:start + block_size], extra_keys)
            new_hashes.append(parent)
            start += block_size
        return new_hashes

    return request_block_hasher


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """Bookkeeping for one physical KV block (the KV itself lives on the worker).

    ``block_hash`` and ``token_ids`` are set only while the block is FULL and in
    the prefix cache; ``token_ids`` lets a hit be checked against a collision.
    Equality is identity: two handles are the same block only if they are.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None
    # Links of FreeKVCacheBlockQueue; None while the block is not in the queue.
    prev_free_block: KVCacheBlock | None = field(default=None, repr=False)
    next_free_block: KVCacheBlock | None = field(default=None, repr=False)
    is_null: bool = False

    def reset_hash(self) -> None:
        self.block_hash = None
        self.token_ids = None


class FreeKVCacheBlockQueue:
    """Free blocks as a doubly linked list with sentinel head and tail.

    Allocation pops from the head, freed blocks are appended at the tail (so
    the head is the least recently freed block, evicted first), and a cached
    block hit again is removed from the middle in O(1).
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(block_id=-1)
        self._tail = KVCacheBlock(block_id=-1)
        chain = [self._head, *blocks, self._tail]
        for prev, nxt in zip(chain, chain[1:]):
            prev.next_free_block = nxt
            nxt.prev_free_block = prev
        self._head.prev_free_block = None
        self._tail.next_free_block = None

    def popleft(self) -> KVCacheBlock:
        """Removes and returns the head block; ValueError when the queue is empty."""
        block = self._head.next_free_block
        if block is self._tail or block is None:
            raise ValueError("No free blocks available")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Removes and returns the first n blocks, head first."""
        if not 0 <= n <= self.num_free_blocks:
            raise ValueError(f"Cannot pop {n} blocks: must be in [0, {self.num_free_blocks}]")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        """Unlinks a block from anywhere in the queue in O(1)."""
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"Block {block.block_id} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Puts a block at the tail (evicted last)."""
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise ValueError(f"Block {block.block_id} is already in the free queue")
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        """Appends blocks at the tail in the given order."""
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every free block, head to tail (O(n): for tests and snapshots)."""
        blocks = []
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            blocks.append(block)
            block = block.next_free_block
        return blocks
