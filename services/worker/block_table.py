"""Per-request block table of the persistent batch (vLLM V1's BlockTable).

Row ``r`` holds the physical KV block ids of the request in batch row ``r``,
logical block ``i`` in column ``i``. The table is edited on the CPU (numpy view
of a pinned tensor on CUDA) as the scheduler's diffs arrive, and copied to the
device once per step by :meth:`BlockTable.commit`; the slot mapping is then
computed on the device from that copy.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.slot_mapping import compute_slot_mapping


class BlockTable:
    """Block ids per batch row, staged on the CPU and committed to ``device``.

    Contract: ``add_row`` replaces a row, ``append_row`` extends it,
    ``clear_row`` empties it and ``move_row`` follows the input batch's
    condense (a row moves into an empty one). Entries beyond a row's
    ``num_blocks_per_row`` hold stale ids that nothing reads: the slot mapping
    and the attention kernel only index blocks that cover the request's
    positions.
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_num_blocks_per_req: int,
        max_num_batched_tokens: int,
        device: torch.device,
        block_size: int,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.max_num_reqs = max_num_reqs
        self.max_num_blocks_per_req = max_num_blocks_per_req
        self.block_size = block_size
        self.device = torch.device(device)
        on_cpu = self.device.type == "cpu"
        self.block_table_cpu = torch.zeros(
            (max_num_reqs, max_num_blocks_per_req),
            dtype=torch.int32,
            pin_memory=not on_cpu and torch.cuda.is_available(),
        )
        self.block_table_np = self.block_table_cpu.numpy()
        # On the CPU the staging table IS the device table: commit costs nothing.
        self.block_table = (
            self.block_table_cpu
            if on_cpu
            else torch.zeros_like(self.block_table_cpu, device=self.device)
        )
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)
        self.slot_mapping = torch.full(
            (max_num_batched_tokens,), -1, dtype=torch.int64, device=self.device
        )

    def append_row(self, block_ids: list[int], row: int) -> None:
        """Appends ``block_ids`` after the row's current blocks."""
        if not block_ids:
            return
        start = int(self.num_blocks_per_row[row])
        end = start + len(block_ids)
        if end > self.max_num_blocks_per_req:
            raise ValueError(
                f"row {row} would hold {end} blocks; allowed range is "
                f"[0, {self.max_num_blocks_per_req}] (max_model_len / block_size)"
            )
        self.block_table_np[row, start:end] = block_ids
        self.num_blocks_per_row[row] = end

    def add_row(self, block_ids: list[int], row: int) -> None:
        """Replaces row ``row`` with ``block_ids`` (a new or resumed request)."""
        self.num_blocks_per_row[row] = 0
        self.append_row(block_ids, row)

    def clear_row(self, row: int) -> None:
        """Empties row ``row`` (its request left the batch)."""
        self.num_blocks_per_row[row] = 0

    def move_row(self, src: int, dst: int) -> None:
        """Copies row ``src`` into the empty row ``dst`` (condense)."""
        num_blocks = int(self.num_blocks_per_row[src])
        self.block_table_np[dst, :num_blocks] = self.block_table_np[src, :num_blocks]
        self.num_blocks_per_row[dst] = num_blocks
        self.num_blocks_per_row[src] = 0

    def commit(self, num_reqs: int) -> None:
        """Copies the first ``num_reqs`` rows to the device in one transfer."""
        if self.block_table is self.block_table_cpu:
            return
        self.block_table[:num_reqs].copy_(self.block_table_cpu[:num_reqs], non_blocking=True)

    def get_device_tensor(self, num_reqs: int) -> torch.Tensor:
        """The committed table's first ``num_reqs`` rows, as attention reads it."""
        return self.block_table[:num_reqs]

    def compute_slot_mapping(
        self,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        num_reqs: int,
        num_actual_tokens: int,
    ) -> torch.Tensor:
        """Slot of every scheduled token, ``-1`` for padding beyond ``num_actual_tokens``.

        ``query_start_loc`` (int32, ``num_reqs + 1``) and ``positions`` (int64,
        padded length) live on the device; call after :meth:`commit`. Returns a
        view of a buffer reused every step, as long as ``positions``.
        """
        out = self.slot_mapping[: positions.shape[0]]
        return compute_slot_mapping(
            self.block_table,
            query_start_loc,
            positions,
            self.block_size,
            num_reqs,
            num_actual_tokens,
            out=out,
        )
