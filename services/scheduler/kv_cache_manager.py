"""KVCacheManager: which blocks each request holds, prefix-cache hits, store mirror."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from services.common.block_hash import BlockHash
from services.scheduler.block_pool import BlockPool
from services.scheduler.kv_cache_utils import KVCacheBlock
from services.scheduler.kv_store import KVStateDelta, KVStateSnapshot, KVStore
from services.scheduler.request import Request


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache lookups since the last ``make_prefix_cache_stats``."""

    requests: int = 0  # lookups made
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found in the cache


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Allocates KV blocks to requests in one worker's pool, with prefix caching.

    ``num_blocks`` includes the null block 0, so ``num_blocks - 1`` blocks hold
    KV. With a ``store``, the constructor recovers the prefix cache the store
    holds for the same ``num_blocks`` and ``block_size`` (otherwise clears it),
    leaving out ``dirty_block_ids`` (blocks whose KV may have changed since the
    store saw them), and ``commit()`` pushes each step's changes as one delta.

    A block cached while a step is scheduled holds KV only once the worker has
    computed that step. With steps in flight (asynchronous scheduling) the
    store leaves such blocks out until their step is committed
    (``end_schedule`` tags them with it), so a recovered index never names a
    block whose KV was never written.
    """

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int,
                 enable_caching: bool = True, store: KVStore | None = None,
                 dirty_block_ids: Collection[int] = ()) -> None:
        if block_size < 1:
            raise ValueError(f"block_size is {block_size}, must be >= 1")
        if max_model_len < 1:
            raise ValueError(f"max_model_len is {max_model_len}, must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are in the prefix cache.
        self.num_cached_block: dict[str, int] = {}
        self._stats = PrefixCacheStats()
        self.store = store
        self._dirty_req_ids: set[str] = set()
        # Blocks cached by the step being scheduled, then by each step in flight.
        self._newly_cached: list[int] = []
        self._unwritten: dict[int, list[int]] = {}
        self._stored_unwritten: set[int] = set()  # those the last delta left out
        if store is not None:
            self._recover(store, set(dirty_block_ids))

    def _recover(self, store: KVStore, dirty_block_ids: set[int]) -> None:
        """Restores the stored prefix cache but the dirty blocks, then rewrites the
        store from memory.

        Every block starts free: the requests that held them died with the
        previous scheduler, and the store's request lists go with them.
        """
        snapshot = store.load()
        geometry = (self.num_blocks, self.block_size)
        if (self.enable_caching and snapshot is not None
                and (snapshot.num_blocks, snapshot.block_size) == geometry):
            entries = snapshot.cached_blocks_in_eviction_order()
            self.block_pool.restore_cached_blocks(
                [entry for entry in entries if entry[0] not in dirty_block_ids])
        self._commit(clear=True)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached FULL blocks that prefixes the request.

        Returns (blocks, num_computed_tokens). A hit stops one token short of
        the request's end, rounded down to whole blocks: the last token is
        always computed to get its logits. ([], 0) when caching is off or the
        request wants prompt logprobs (they need every prompt position).
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_num_blocks = (request.num_tokens - 1) // self.block_size
        token_ids, block_size = request.all_token_ids, self.block_size
        computed: list[KVCacheBlock] = []
        for i, block_hash in enumerate(request.block_hashes[:max_num_blocks]):
            block = self.block_pool.get_cached_block(
                block_hash, token_ids[i * block_size:(i + 1) * block_size])
            if block is None:
                break
            computed.append(block)
        num_computed_tokens = len(computed) * self.block_size
        self._stats.requests += 1
        self._stats.queries += request.num_tokens
        self._stats.hits += num_computed_tokens
        return computed, num_computed_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       num_lookahead_tokens: int = 0) -> list[KVCacheBlock] | None:
        """Makes room for ``num_new_tokens`` more tokens of the request.

        ``new_computed_blocks`` (from ``get_computed_blocks``, first scheduling
        only) are shared: their ref count goes up and free ones leave the free
        queue. Missing blocks come from the free-queue head, evicting cached
        ones. Then every block that is FULL once these tokens are computed is
        cached. Returns the newly allocated blocks, or None when the pool is
        too small, in which case nothing at all has changed.
        """
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens is {num_new_tokens}, must be >= 1")
        req_id = request.request_id
        if not (new_computed_blocks or num_new_computed_tokens or num_lookahead_tokens) \
                and self._fits_held_blocks(request, num_new_tokens):
            return []  # most decode steps: nothing to allocate or cache
        new_computed_blocks = new_computed_blocks or []
        num_held = len(self.req_to_blocks.get(req_id, ()))
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_required_tokens = min(num_computed_tokens + num_new_tokens + num_lookahead_tokens,
                                  self.max_model_len)
        num_new_blocks = max(cdiv(num_required_tokens, self.block_size)
                             - num_held - len(new_computed_blocks), 0)
        # A free hit block leaves the free queue, so it costs a free block too.
        num_free_hits = (sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
                         if new_computed_blocks else 0)
        if num_new_blocks + num_free_hits > self.block_pool.get_num_free_blocks():
            return None

        req_blocks = self.req_to_blocks.setdefault(req_id, [])
        if new_computed_blocks:
            # Touch before allocating so the pops below cannot evict a hit block.
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
            self.num_cached_block[req_id] = len(req_blocks)
        # Most decode steps need no new block.
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        req_blocks.extend(new_blocks)
        if new_computed_blocks or new_blocks:
            self._dirty_req_ids.add(req_id)

        if self.enable_caching:
            # Lookahead slots hold no real tokens yet, so they are never cached.
            num_full_blocks = self._num_full_blocks(request, num_computed_tokens + num_new_tokens)
            num_cached = self.num_cached_block.get(req_id, 0)
            if num_full_blocks > num_cached:
                self.block_pool.cache_full_blocks(request, req_blocks, num_cached,
                                                  num_full_blocks, self.block_size)
                self.num_cached_block[req_id] = num_full_blocks
                if self.store is not None:
                    self._newly_cached.extend(
                        b.block_id for b in req_blocks[num_cached:num_full_blocks])
        return new_blocks

    def _fits_held_blocks(self, request: Request, num_new_tokens: int) -> bool:
        """Whether the request's blocks already hold these tokens and they fill
        no block that is not cached yet (allocate_slots would change nothing)."""
        req_blocks = self.req_to_blocks.get(request.request_id)
        end = request.num_computed_tokens + num_new_tokens
        if req_blocks is None or end > len(req_blocks) * self.block_size:
            return False
        return (not self.enable_caching or self._num_full_blocks(request, end)
                <= self.num_cached_block.get(request.request_id, 0))

    def _num_full_blocks(self, request: Request, num_tokens: int) -> int:
        """Blocks full of known tokens once ``num_tokens`` positions are computed
        (placeholders for tokens still being sampled fill none)."""
        return min(num_tokens, request.num_tokens) // self.block_size

    def free(self, request: Request, uncache: bool = False) -> None:
        """Releases the request's blocks in REVERSE order.

        Blocks reaching ref count 0 join the free-queue tail, the request's last
        block first, so a sequence's tail is evicted before its shared head.
        ``uncache`` also forgets the hashes of those blocks: their contents are
        in doubt (the worker failed the request, perhaps before writing them).
        """
        req_id = request.request_id
        blocks = self.req_to_blocks.pop(req_id, [])
        self.num_cached_block.pop(req_id, None)
        self.block_pool.free_blocks(reversed(blocks))
        if uncache:
            self.block_pool.evict_cached_blocks(b for b in blocks if b.ref_cnt == 0)
        self._dirty_req_ids.add(req_id)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block; False (a no-op) while any block is in use."""
        return self.block_pool.reset_prefix_cache()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def num_cached_blocks(self) -> int:
        return self.block_pool.num_cached_blocks

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a request of num_tokens could ever fit in an empty pool."""
        return cdiv(num_tokens, self.block_size) <= self.num_blocks - 1

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Stats since the last call (and resets them)."""
        stats, self._stats = self._stats, PrefixCacheStats()
        return stats

    def end_schedule(self, step_id: int) -> None:
        """Tags the blocks cached while scheduling step ``step_id`` with it."""
        if self._newly_cached:
            self._unwritten[step_id] = self._newly_cached
            self._newly_cached = []

    def commit(self, step_id: int = 0) -> None:
        """Pushes everything changed since the last commit to the store as one
        delta tagged ``step_id``; the whole state instead when the store asks for
        it. No-op when nothing changed or there is no store.

        Call it once the worker has computed every step up to ``step_id``:
        blocks cached by later steps (in flight) stay out of the store.
        """
        self._commit(clear=False, step_id=step_id)

    def _commit(self, clear: bool, step_id: int = 0) -> None:
        changes = self.block_pool.take_changes()
        req_ids, self._dirty_req_ids = self._dirty_req_ids, set()
        if self.store is None:
            return
        for written_step_id in [s for s in self._unwritten if s <= step_id]:
            del self._unwritten[written_step_id]
        unwritten = self._unwritten_block_ids()
        for block_id in self._stored_unwritten - unwritten:
            # Written now. The last delta left them out, so the store holds
            # nothing for them, whatever the pool's own record says.
            changes[block_id] = None
        self._stored_unwritten = unwritten
        if not clear and self.store.wants_full_state():
            self.store.apply(self._make_full_delta(step_id))
        elif clear or changes or req_ids:
            self.store.apply(self._make_delta(changes, req_ids, clear, step_id, unwritten))

    def _unwritten_block_ids(self) -> set[int]:
        """Cached blocks whose KV a step in flight still writes."""
        return {block_id for block_ids in self._unwritten.values() for block_id in block_ids}

    def _make_full_delta(self, step_id: int) -> KVStateDelta:
        """A clear delta carrying every cached block and every request's blocks."""
        cached = self.block_pool.cached_block_hash_to_block.values()
        as_new = {block_id: None for same_hash in cached for block_id in same_hash}
        return self._make_delta(as_new, set(self.req_to_blocks), True, step_id,
                                self._stored_unwritten)

    def _make_delta(self, changes: dict[int, BlockHash | None], req_ids: set[str],
                    clear: bool, step_id: int, unwritten: set[int]) -> KVStateDelta:
        """Each changed block's new value as the store sees it: a block in
        ``unwritten`` (KV not written yet) counts as not cached."""
        pool = self.block_pool
        delta = KVStateDelta(self.num_blocks, self.block_size, pool.get_num_free_blocks(), clear,
                             step_id)
        changed_hashes: set[BlockHash] = set()
        for block_id, old_hash in changes.items():
            block = pool.blocks[block_id]
            new_hash = None if block_id in unwritten else block.block_hash
            if new_hash != old_hash:
                changed_hashes.update(h for h in (old_hash, new_hash) if h is not None)
                delta.block_token_ids[block_id] = (list(block.token_ids)
                                                   if new_hash is not None else None)
            is_cached_free = new_hash is not None and block.ref_cnt == 0
            delta.free_seq[block_id] = pool.get_free_seq(block_id) if is_cached_free else None
        for block_hash in changed_hashes:
            same_hash = pool.cached_block_hash_to_block.get(block_hash, {})
            written = sorted(b for b in same_hash if b not in unwritten)
            delta.prefix_index[block_hash.hex()] = written or None
        for req_id in req_ids:
            blocks = self.req_to_blocks.get(req_id)
            delta.req_blocks[req_id] = None if blocks is None else [b.block_id for b in blocks]
        return delta

    def snapshot(self) -> KVStateSnapshot:
        """The in-memory state in the store's shape (to check the mirror)."""
        pool = self.block_pool
        unwritten = self._unwritten_block_ids()
        index = {h: [b for b in same if b not in unwritten]
                 for h, same in pool.cached_block_hash_to_block.items()}
        index = {h: same for h, same in index.items() if same}
        cached_blocks = [pool.blocks[b] for same in index.values() for b in same]
        return KVStateSnapshot(
            self.num_blocks, self.block_size, pool.get_num_free_blocks(),
            cached={h.hex(): sorted(same) for h, same in index.items()},
            req_blocks={r: [b.block_id for b in bs] for r, bs in self.req_to_blocks.items()},
            block_token_ids={b.block_id: list(b.token_ids or ()) for b in cached_blocks},
            free_order=[b.block_id for b in pool.free_block_queue.get_all_free_blocks()
                        if b.block_hash is not None and b.block_id not in unwritten],
        )
