"""The KV block handle and the free-block queue (vLLM V1 names)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.block_hash import BlockHash


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
