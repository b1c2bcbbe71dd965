"""Consistency checks over a Scheduler and its block pool (for tests and debugging).

``check_invariants`` walks every block and request, so it is O(pool + requests):
call it between steps in tests, never on the serving path. The checks are
``assert`` statements, so they vanish under ``python -O``.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from services.scheduler.request import RequestStatus

if TYPE_CHECKING:
    from services.scheduler.kv_cache_manager import KVCacheManager
    from services.scheduler.scheduler import Scheduler


def check_invariants(scheduler: Scheduler, check_store: bool = True) -> None:
    """Raises AssertionError naming the first broken invariant.

    Queues: every live request is in exactly one of waiting / running with a
    matching status. Blocks: each is free xor referenced, ref counts equal the
    number of requests holding the block, the null block is never handed out,
    the prefix index matches the blocks' hashes. With ``check_store`` (only
    meaningful right after a commit, i.e. after update_from_output), the
    store's state equals the in-memory snapshot.
    """
    kv = scheduler.kv_cache_manager
    _check_queues(scheduler)
    _check_request_blocks(scheduler)
    _check_block_pool(kv)
    if check_store and kv.store is not None:
        stored, in_memory = kv.store.load(), kv.snapshot()
        assert stored == in_memory, f"store mirror differs:\nstore:  {stored}\nmemory: {in_memory}"


def _check_queues(scheduler: Scheduler) -> None:
    waiting = list(scheduler.waiting)
    running = scheduler.running
    waiting_ids = {r.request_id for r in waiting}
    running_ids = {r.request_id for r in running}
    assert len(waiting_ids) == len(waiting), "a request is queued twice in waiting"
    assert len(running_ids) == len(running), "a request is queued twice in running"
    both = waiting_ids & running_ids
    assert not both, f"requests both waiting and running: {sorted(both)}"
    live = waiting_ids | running_ids
    assert live == scheduler.requests.keys(), (
        f"queued requests {sorted(live)} != scheduler.requests {sorted(scheduler.requests)}"
    )
    assert len(running) <= scheduler.config.limits.max_num_seqs, (
        f"{len(running)} running, max_num_seqs is {scheduler.config.limits.max_num_seqs}"
    )
    for r in waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), (
            f"waiting request {r.request_id} has status {r.status.name}"
        )
        assert r.num_computed_tokens == 0, (
            f"waiting request {r.request_id} has num_computed_tokens {r.num_computed_tokens}, expected 0"
        )
    for r in running:
        assert r.status == RequestStatus.RUNNING, f"running request {r.request_id} has status {r.status.name}"
        # Steps in flight compute the positions of the tokens they sample but the
        # last (placeholders), drafts included.
        most = r.num_tokens + max(r.num_output_placeholders - 1, 0)
        assert 0 < r.num_computed_tokens <= most and r.num_tokens < scheduler.max_model_len, (
            f"running request {r.request_id}: num_computed_tokens {r.num_computed_tokens}, "
            f"num_tokens {r.num_tokens}, {r.num_output_placeholders} placeholders, "
            f"max_model_len {scheduler.max_model_len}"
        )


def _check_request_blocks(scheduler: Scheduler) -> None:
    """Running requests hold exactly the blocks their computed tokens need; others none."""
    kv = scheduler.kv_cache_manager
    block_size = kv.block_size
    holders = {req_id for req_id, blocks in kv.req_to_blocks.items() if blocks}
    running = {r.request_id for r in scheduler.running}
    assert holders <= running, f"requests hold blocks but are not running: {sorted(holders - running)}"
    # Slots of rejected drafts stay with their request for its next drafts.
    num_spec = scheduler.config.num_speculative_tokens
    for r in scheduler.running:
        blocks = kv.req_to_blocks.get(r.request_id, [])
        expected = -(-r.num_computed_tokens // block_size)
        most = -(-(r.num_computed_tokens + num_spec) // block_size)
        assert expected <= len(blocks) <= most, (
            f"request {r.request_id} holds {len(blocks)} blocks for "
            f"{r.num_computed_tokens} computed tokens, expected {expected}"
            + (f" to {most} (draft slots)" if most > expected else "")
        )
        for i, block in enumerate(blocks):
            assert not block.is_null, f"request {r.request_id} holds the null block"
            if block.block_hash is None:
                continue
            # A cached block must hold exactly this request's tokens at that position.
            tokens = tuple(r.all_token_ids[i * block_size:(i + 1) * block_size])
            assert block.block_hash == r.block_hashes[i] and block.token_ids == tokens, (
                f"request {r.request_id} block {i} (id {block.block_id}) is cached "
                "under another sequence's hash or tokens"
            )


def _check_block_pool(kv: KVCacheManager) -> None:
    pool = kv.block_pool
    null = pool.null_block
    assert null.is_null and null.block_id == 0, f"null block is {null}"
    assert null.block_hash is None, "null block is in the prefix cache"

    holders = Counter(b.block_id for blocks in kv.req_to_blocks.values() for b in blocks)
    assert holders[0] == 0, f"the null block is held by {holders[0]} requests"
    free = pool.free_block_queue.get_all_free_blocks()
    free_ids = [b.block_id for b in free]
    assert len(free_ids) == len(set(free_ids)) == pool.get_num_free_blocks(), (
        f"free queue {free_ids} has duplicates or num_free_blocks {pool.get_num_free_blocks()} is wrong"
    )
    assert 0 not in free_ids, "null block is in the free queue"
    free_set = set(free_ids)
    for block in pool.blocks[1:]:
        assert block.ref_cnt == holders[block.block_id], (
            f"block {block.block_id} has ref_cnt {block.ref_cnt}, "
            f"held by {holders[block.block_id]} requests"
        )
        is_free = block.block_id in free_set
        assert is_free == (block.ref_cnt == 0), (
            f"block {block.block_id}: in free queue {is_free}, ref_cnt {block.ref_cnt}"
        )

    num_indexed = 0
    for block_hash, same_hash in pool.cached_block_hash_to_block.items():
        assert same_hash, f"empty prefix-index entry for hash {block_hash.hex()}"
        for block_id, block in same_hash.items():
            assert block.block_id == block_id and block.block_hash == block_hash, (
                f"prefix index maps {block_hash.hex()} to block {block_id} whose hash is "
                f"{block.block_hash.hex() if block.block_hash else None}"
            )
            num_indexed += 1
    num_hashed = sum(b.block_hash is not None for b in pool.blocks)
    assert num_indexed == num_hashed == pool.num_cached_blocks, (
        f"{num_indexed} indexed, {num_hashed} hashed, num_cached_blocks {pool.num_cached_blocks}"
    )
