"""Triton kernel: KV-cache write, one program per token; slot -1 is skipped."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# Bytes one thread moves per access: a 16-byte vector (ld/st.global.v4).
_VECTOR_BYTES = 16


def _num_warps(block_head_dim: int, element_size: int) -> int:
    """Warps that copy one token's row in a single pass of 16-byte vectors, 1 to 8.

    The default 4 warps would leave a 3 x 64 bf16 row (512 bytes) at 4 bytes per
    thread; one warp moves it with one vector per thread, and an 8 x 128 row takes 4.
    """
    return max(1, min(8, block_head_dim * element_size // (32 * _VECTOR_BYTES)))


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr,                  # [num_tokens, num_kv_heads, head_size]
    key_cache_ptr, value_cache_ptr,      # [num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping_ptr,                    # int64 [num_tokens]
    key_stride_token, key_stride_head,
    value_stride_token, value_stride_head,
    cache_stride_block, cache_stride_offset, cache_stride_head,
    block_size,
    HEAD_SIZE: tl.constexpr,
    BLOCK_HEAD_DIM: tl.constexpr,        # next power of two >= num_kv_heads * head_size
    NUM_ELEMENTS: tl.constexpr,          # num_kv_heads * head_size
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:  # padding token
        return
    block = slot // block_size
    offset = slot % block_size
    idx = tl.arange(0, BLOCK_HEAD_DIM)
    mask = idx < NUM_ELEMENTS
    head = idx // HEAD_SIZE
    dim = idx % HEAD_SIZE
    cache_off = block * cache_stride_block + offset * cache_stride_offset + head * cache_stride_head + dim
    key = tl.load(key_ptr + token * key_stride_token + head * key_stride_head + dim, mask=mask)
    value = tl.load(value_ptr + token * value_stride_token + head * value_stride_head + dim, mask=mask)
    tl.store(key_cache_ptr + cache_off, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + cache_off, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


def launch_reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                             value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store key/value rows at their slots; inputs must be contiguous in the head dim."""
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, strides {t.stride()}")
    if key_cache.stride() != value_cache.stride():
        raise ValueError(f"key/value cache strides differ: {key_cache.stride()} vs {value_cache.stride()}")
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    num_elements = num_kv_heads * head_size
    block_head_dim = triton.next_power_of_2(num_elements)
    element_size = max(key.element_size(), key_cache.element_size())
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        key_cache.shape[1],
        HEAD_SIZE=head_size, BLOCK_HEAD_DIM=block_head_dim, NUM_ELEMENTS=num_elements,
        num_warps=_num_warps(block_head_dim, element_size), num_stages=1,  # no loop to pipeline
    )
