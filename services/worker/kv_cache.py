"""Sizing and allocating the paged KV cache.

Per layer one tensor ``[2, num_blocks, block_size, num_kv_heads, head_size]``
(keys in ``[0]``, values in ``[1]``). Block 0 is the null block: it is
allocated like any other but never handed to a request, so the number of
blocks reported to the scheduler includes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_GIB = 1 << 30
# Fewer than this can hold no request at all (block 0 is reserved).
MIN_NUM_BLOCKS = 2


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    num_layers: int

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block in ONE layer, keys and values together."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_size * element_size

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers (what a block id costs)."""
        return self.page_size_bytes * self.num_layers


def determine_num_blocks(
    spec: KVCacheSpec,
    device: torch.device,
    gpu_memory_utilization: float = 0.9,
    cpu_kv_cache_gib: float = 1.0,
) -> int:
    """Number of KV blocks (null block included) that fit the memory budget.

    CUDA: ``gpu_memory_utilization`` of the memory still free after the model
    was loaded (call it then). CPU: ``cpu_kv_cache_gib`` GiB. Raises
    ``ValueError`` when fewer than two blocks fit.
    """
    device = torch.device(device)
    if device.type == "cuda":
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}"
            )
        free_bytes, _ = torch.cuda.mem_get_info(device)
        budget_bytes = int(free_bytes * gpu_memory_utilization)
        where = f"{gpu_memory_utilization} of {free_bytes / _GIB:.2f} GiB free on {device}"
    else:
        if cpu_kv_cache_gib <= 0:
            raise ValueError(f"kv_cache_gib must be > 0, got {cpu_kv_cache_gib}")
        budget_bytes = int(cpu_kv_cache_gib * _GIB)
        where = f"{cpu_kv_cache_gib} GiB (kv_cache_gib)"
    num_blocks = budget_bytes // spec.bytes_per_block
    if num_blocks < MIN_NUM_BLOCKS:
        raise ValueError(
            f"{where} holds {num_blocks} KV blocks of {spec.bytes_per_block} bytes; "
            f"at least {MIN_NUM_BLOCKS} are needed"
        )
    return num_blocks


def allocate_kv_caches(spec: KVCacheSpec, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
    """One zeroed ``[2, num_blocks, block_size, num_kv_heads, head_size]`` tensor per layer.

    Zeroed so the null block and never-written slots hold finite values: a
    masked-out key must not turn into NaN through ``0 * inf``.
    """
    if num_blocks < MIN_NUM_BLOCKS:
        raise ValueError(f"num_blocks must be >= {MIN_NUM_BLOCKS}, got {num_blocks}")
    shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
    return [
        torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)
    ]
