"""BlockPool: every KV block of one worker, the free queue and the prefix-hash index."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from services.common.block_hash import BlockHash
from services.scheduler.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

if TYPE_CHECKING:
    from services.scheduler.request import Request


class BlockPool:
    """Owns the blocks, the free queue and ``cached_block_hash_to_block``.

    A block is free when its ref count is 0; a free block may still be cached
    (hash set) and can be hit until allocation pops it from the queue head and
    evicts it. Several blocks may share a hash: two requests that computed the
    same block before either was cached each keep their own copy.

    Block 0 is the null block: never allocated, never freed.

    The pool records which blocks changed their cached state or free-queue
    membership (``take_changes``) so the manager can mirror them to a store;
    the record is bounded by ``num_blocks``.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks is {num_blocks}, must be >= 2 (block 0 is the null block)")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        self.num_cached_blocks = 0
        self.num_evicted_blocks = 0  # cumulative: cached blocks popped for new KV
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        # When each block was last appended to the free queue: the order of the
        # cached free blocks, which recovery restores.
        self._free_seq = [0] * num_blocks
        self._num_appended = 0
        # block id -> its hash at the last take_changes() (first change wins).
        self._changes: dict[int, BlockHash | None] = {}

    def get_cached_block(self, block_hash: BlockHash,
                         token_ids: Sequence[int]) -> KVCacheBlock | None:
        """A cached block with this hash AND these token ids, or None.

        Comparing the stored token ids means a hash collision can never serve
        another sequence's KV.
        """
        candidates = self.cached_block_hash_to_block.get(block_hash)
        if not candidates:
            return None
        token_ids = tuple(token_ids)
        for block in candidates.values():
            if block.token_ids == token_ids:
                return block
        return None

    def cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock],
                          num_cached_blocks: int, num_full_blocks: int, block_size: int) -> None:
        """Caches ``blocks[num_cached_blocks:num_full_blocks]`` under the request's hashes."""
        if len(request.block_hashes) < num_full_blocks:
            raise ValueError(f"request {request.request_id} has {len(request.block_hashes)} block "
                             f"hashes, needs >= {num_full_blocks}")
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            self._record_change(block)
            block.block_hash = request.block_hashes[i]
            block.token_ids = tuple(request.all_token_ids[i * block_size:(i + 1) * block_size])
            self.cached_block_hash_to_block.setdefault(block.block_hash, {})[block.block_id] = block
            self.num_cached_blocks += 1

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pops blocks from the free-queue head (evicting cached ones), ref count 1."""
        num_free = self.free_block_queue.num_free_blocks
        if not 0 <= num_blocks <= num_free:
            raise ValueError(f"Cannot get {num_blocks} blocks: must be in [0, {num_free}]")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            self._maybe_evict_cached_block(block)
            block.ref_cnt += 1
        return blocks

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        self._record_change(block)
        same_hash = self.cached_block_hash_to_block[block.block_hash]
        del same_hash[block.block_id]
        if not same_hash:
            del self.cached_block_hash_to_block[block.block_hash]
        block.reset_hash()
        self.num_cached_blocks -= 1
        self.num_evicted_blocks += 1

    def evict_cached_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Forgets the hashes of free ``blocks``: no prefix will hit them again."""
        for block in blocks:
            self._maybe_evict_cached_block(block)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Takes a reference on prefix-hit blocks; a free one leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.remove(block)
                if block.block_hash is not None:
                    self._record_change(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drops a reference on each block; those reaching 0 go to the free-queue
        tail in the given order (they stay cached until evicted)."""
        newly_free = []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and not block.is_null:
                newly_free.append(block)
                self._num_appended += 1
                self._free_seq[block.block_id] = self._num_appended
                if block.block_hash is not None:
                    self._record_change(block)
        self.free_block_queue.append_n(newly_free)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached hash; False (and nothing done) while a block is in use."""
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        for same_hash in self.cached_block_hash_to_block.values():
            for block in same_hash.values():
                self._record_change(block)
                block.reset_hash()
        self.cached_block_hash_to_block.clear()
        self.num_cached_blocks = 0
        return True

    def restore_cached_blocks(self, entries: list[tuple[int, BlockHash, tuple[int, ...]]]) -> None:
        """Re-creates cached free blocks in an untouched pool (recovery).

        ``entries`` are (block id, hash, token ids) in free-queue order, head
        first. The new free queue holds the uncached blocks first (evicted
        first), then the restored ones in the given order.
        """
        if self.num_cached_blocks or self.get_num_free_blocks() != self.num_blocks - 1:
            raise RuntimeError("restore_cached_blocks needs a pool with no cached or used blocks")
        restored: list[KVCacheBlock] = []
        for block_id, block_hash, token_ids in entries:
            if not 1 <= block_id < self.num_blocks or self.blocks[block_id].block_hash is not None:
                raise ValueError(f"block id {block_id} must be in [1, {self.num_blocks - 1}] "
                                 "and listed once")
            block = self.blocks[block_id]
            self._record_change(block)
            block.block_hash, block.token_ids = block_hash, tuple(token_ids)
            self.cached_block_hash_to_block.setdefault(block_hash, {})[block_id] = block
            restored.append(block)
        self.num_cached_blocks = len(restored)
        uncached = [b for b in self.blocks[1:] if b.block_hash is None]
        order = uncached + restored
        for block in order:
            block.prev_free_block = block.next_free_block = None
        self.free_block_queue = FreeKVCacheBlockQueue(order)
        for seq, block in enumerate(order, start=1):
            self._free_seq[block.block_id] = seq
        self._num_appended = len(order)

    def get_free_seq(self, block_id: int) -> int:
        """Position of the block's last append to the free queue (larger = later)."""
        return self._free_seq[block_id]

    def take_changes(self) -> dict[int, BlockHash | None]:
        """Blocks whose cached state or free-queue membership changed since the
        last call, each mapped to the hash it had then; resets the record."""
        changes, self._changes = self._changes, {}
        return changes

    def _record_change(self, block: KVCacheBlock) -> None:
        self._changes.setdefault(block.block_id, block.block_hash)

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of the usable blocks (all but the null block) in use."""
        return 1.0 - self.get_num_free_blocks() / (self.num_blocks - 1)
