"""BlockTable: row edits and the slot mapping they produce (block_size 16)."""

from __future__ import annotations

import torch

from services.worker.block_table import BlockTable

BLOCK_SIZE = 16


def make_table(max_num_reqs: int = 4, max_blocks: int = 8, max_tokens: int = 64) -> BlockTable:
    return BlockTable(max_num_reqs, max_blocks, max_tokens, torch.device("cpu"), BLOCK_SIZE)


def row(table: BlockTable, r: int) -> list[int]:
    return table.block_table_np[r, : table.num_blocks_per_row[r]].tolist()


def test_add_append_move_clear():
    table = make_table()
    table.add_row([7, 3], 0)
    table.append_row([9], 0)
    table.append_row([], 0)
    table.add_row([5], 1)
    assert row(table, 0) == [7, 3, 9]
    assert row(table, 1) == [5]

    table.add_row([2, 4], 0)  # resumed request: replaces the row
    assert row(table, 0) == [2, 4]

    table.move_row(0, 2)
    assert row(table, 2) == [2, 4]
    assert table.num_blocks_per_row[0] == 0

    table.clear_row(1)
    assert row(table, 1) == []


def test_append_past_max_blocks_raises():
    table = make_table(max_blocks=2)
    table.add_row([1, 2], 0)
    try:
        table.append_row([3], 0)
    except ValueError as e:
        assert "allowed range is [0, 2]" in str(e)
    else:
        raise AssertionError("append past max_num_blocks_per_req must raise")


def test_slot_mapping_blocks_out_of_order_and_padding():
    table = make_table()
    # Request 0 holds blocks [7, 3, 9]: positions 14..17 of a chunk cross from
    # block 3 (offsets 14, 15) into block 9 (offsets 0, 1).
    table.add_row([7, 3, 9], 0)
    table.add_row([2], 1)
    table.add_row([4, 1], 2)
    table.commit(3)
    positions = torch.tensor(
        [30, 31, 32, 33]  # request 0: positions 30..33 (block 3 -> block 9)
        + [5]  # request 1: one decode token at position 5 of block 2
        + [0, 15, 16]  # request 2: 3 prefill tokens across blocks 4 and 1
        + [0, 0],  # padding
        dtype=torch.int64,
    )
    query_start_loc = torch.tensor([0, 4, 5, 8], dtype=torch.int32)
    slots = table.compute_slot_mapping(query_start_loc, positions, num_reqs=3, num_actual_tokens=8)
    assert slots.tolist() == [
        3 * 16 + 14, 3 * 16 + 15, 9 * 16 + 0, 9 * 16 + 1,
        2 * 16 + 5,
        4 * 16 + 0, 4 * 16 + 15, 1 * 16 + 0,
        -1, -1,
    ]  # fmt: skip
    # The result is a view of the table's reusable buffer.
    assert slots.data_ptr() == table.slot_mapping.data_ptr()


def test_slot_mapping_follows_moved_rows():
    table = make_table()
    table.add_row([7], 0)
    table.add_row([8], 1)
    table.add_row([6], 2)
    table.clear_row(0)
    table.move_row(2, 0)  # condense: the tail row fills the hole
    table.commit(2)
    slots = table.compute_slot_mapping(
        torch.tensor([0, 1, 2], dtype=torch.int32),
        torch.tensor([3, 4], dtype=torch.int64),
        num_reqs=2,
        num_actual_tokens=2,
    )
    assert slots.tolist() == [6 * 16 + 3, 8 * 16 + 4]
