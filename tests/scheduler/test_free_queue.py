"""FreeKVCacheBlockQueue: order of popleft / remove / append, O(1) links."""

from __future__ import annotations

import pytest

from services.scheduler.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock


def make_queue(n: int) -> tuple[FreeKVCacheBlockQueue, list[KVCacheBlock]]:
    blocks = [KVCacheBlock(block_id=i) for i in range(n)]
    return FreeKVCacheBlockQueue(blocks), blocks


def ids(queue: FreeKVCacheBlockQueue) -> list[int]:
    return [b.block_id for b in queue.get_all_free_blocks()]


def test_initial_order_is_block_order():
    queue, _ = make_queue(5)
    assert ids(queue) == [0, 1, 2, 3, 4]
    assert queue.num_free_blocks == 5


def test_popleft_takes_the_head_and_unlinks_it():
    queue, blocks = make_queue(4)
    assert queue.popleft() is blocks[0]
    assert blocks[0].prev_free_block is None and blocks[0].next_free_block is None
    assert [b.block_id for b in queue.popleft_n(2)] == [1, 2]
    assert ids(queue) == [3]
    assert queue.num_free_blocks == 1


def test_remove_from_middle_head_and_tail():
    queue, blocks = make_queue(6)
    queue.remove(blocks[3])
    assert ids(queue) == [0, 1, 2, 4, 5]
    queue.remove(blocks[0])
    queue.remove(blocks[5])
    assert ids(queue) == [1, 2, 4]
    assert queue.num_free_blocks == 3
    assert queue.popleft() is blocks[1]


def test_append_goes_to_the_tail_in_order():
    queue, blocks = make_queue(4)
    popped = queue.popleft_n(3)  # 0, 1, 2 out; 3 left
    queue.append(popped[1])
    assert ids(queue) == [3, 1]
    queue.append_n([popped[2], popped[0]])
    assert ids(queue) == [3, 1, 2, 0]
    assert queue.num_free_blocks == 4
    assert [queue.popleft().block_id for _ in range(4)] == [3, 1, 2, 0]


def test_remove_then_append_moves_block_to_tail():
    queue, blocks = make_queue(4)
    queue.remove(blocks[1])
    queue.append(blocks[1])
    assert ids(queue) == [0, 2, 3, 1]


def test_popleft_on_empty_raises():
    queue, _ = make_queue(2)
    queue.popleft_n(2)
    assert queue.num_free_blocks == 0 and ids(queue) == []
    with pytest.raises(ValueError, match="No free blocks"):
        queue.popleft()


def test_popleft_n_beyond_free_count_raises_and_takes_nothing():
    queue, _ = make_queue(3)
    with pytest.raises(ValueError, match=r"Cannot pop 4 blocks: must be in \[0, 3\]"):
        queue.popleft_n(4)
    assert ids(queue) == [0, 1, 2]


def test_remove_of_a_block_not_in_queue_raises():
    queue, blocks = make_queue(3)
    queue.popleft()
    with pytest.raises(ValueError, match="Block 0 is not in the free queue"):
        queue.remove(blocks[0])


def test_append_of_a_queued_block_raises():
    queue, blocks = make_queue(3)
    with pytest.raises(ValueError, match="Block 1 is already in the free queue"):
        queue.append(blocks[1])
    assert ids(queue) == [0, 1, 2]
