"""Triton kernel: slot mapping, one program per block of tokens."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_TOKENS_PER_PROGRAM = 256


@triton.jit
def _compute_slot_mapping_kernel(
    block_table_ptr,        # int32 [max_num_reqs, max_num_blocks_per_req]
    block_table_stride,
    query_start_loc_ptr,    # int32 [num_reqs + 1]
    positions_ptr,          # int64 [num_tokens_padded]
    slot_mapping_ptr,       # int64 [num_tokens_padded]
    block_size,
    num_reqs,
    num_search_steps,       # bit length of num_reqs: binary-search iterations
    num_actual_tokens,
    num_tokens_padded,
    PAD_ID: tl.constexpr,
    BLOCK: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    is_real = tokens < num_actual_tokens
    # Request of each token = number of request ends (query_start_loc[1:]) <= token,
    # found by a vectorized binary search over [0, num_reqs).
    lo = tl.zeros([BLOCK], dtype=tl.int32)
    hi = tl.zeros([BLOCK], dtype=tl.int32) + num_reqs
    for _ in range(num_search_steps):
        active = lo < hi
        mid = (lo + hi) // 2
        end = tl.load(query_start_loc_ptr + mid + 1, mask=active & is_real, other=0)
        go_right = active & (end <= tokens)
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(active & ~go_right, mid, hi)
    pos = tl.load(positions_ptr + tokens, mask=is_real, other=0)
    block_ids = tl.load(block_table_ptr + lo.to(tl.int64) * block_table_stride + pos // block_size,
                        mask=is_real, other=0).to(tl.int64)
    slots = tl.where(is_real, block_ids * block_size + pos % block_size, PAD_ID)
    tl.store(slot_mapping_ptr + tokens, slots, mask=tokens < num_tokens_padded)


def launch_compute_slot_mapping(block_table: torch.Tensor, query_start_loc: torch.Tensor,
                                positions: torch.Tensor, block_size: int, num_reqs: int,
                                num_actual_tokens: int, out: torch.Tensor) -> None:
    """Fill out[:positions.numel()] with slots (-1 past num_actual_tokens)."""
    if block_table.stride(1) != 1:
        raise ValueError(f"block_table must be contiguous in its last dim, strides {block_table.stride()}")
    num_tokens_padded = positions.shape[0]
    if num_tokens_padded == 0:
        return
    grid = (triton.cdiv(num_tokens_padded, _TOKENS_PER_PROGRAM),)
    _compute_slot_mapping_kernel[grid](
        block_table, block_table.stride(0), query_start_loc, positions, out,
        block_size, num_reqs, int(num_reqs).bit_length(), num_actual_tokens, num_tokens_padded,
        PAD_ID=-1, BLOCK=_TOKENS_PER_PROGRAM,
        # 4 warps: 2 tokens per thread, one 16-byte int64 vector per store. 1 stage: each
        # binary-search load depends on the previous one, so there is nothing to prefetch.
        num_warps=4, num_stages=1,
    )
