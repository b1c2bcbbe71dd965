"""A picture of one worker's block pool for the dashboard: which blocks are in use,
cached and free, or free.

Built on request (GetStats with ``include_block_map``), never on a step's
path: it scans every block once.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.block_pool import BlockPool

# Cell states, ordered so that a cell of several blocks shows its most used one.
FREE = 0
CACHED_FREE = 1  # free, but its KV still answers a prefix hit until evicted
USED = 2

# At most this many cells: a large pool is drawn with several blocks per cell.
MAX_CELLS = 4096


@dataclass(slots=True, frozen=True)
class BlockMap:
    """``cells[i]`` is the state of blocks ``[1 + i * blocks_per_cell, ...)``."""

    cells: bytes
    blocks_per_cell: int
    num_cached_free_blocks: int


def make_block_map(pool: BlockPool, max_cells: int = MAX_CELLS) -> BlockMap:
    """Each usable block's state (the null block 0 is left out), ``max_cells`` at most."""
    if max_cells < 1:
        raise ValueError(f"max_cells is {max_cells}, must be >= 1")
    blocks = pool.blocks[1:]
    blocks_per_cell = max(1, -(-len(blocks) // max_cells))
    cells = bytearray(-(-len(blocks) // blocks_per_cell))
    num_cached_free = 0
    for index, block in enumerate(blocks):
        if block.ref_cnt > 0:
            state = USED
        elif block.block_hash is not None:
            state = CACHED_FREE
            num_cached_free += 1
        else:
            continue
        cell = index // blocks_per_cell
        if state > cells[cell]:
            cells[cell] = state
    return BlockMap(bytes(cells), blocks_per_cell, num_cached_free)
