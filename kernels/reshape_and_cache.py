"""Write the new tokens' K/V into the paged KV cache at their slots (vLLM reshape_and_cache_flash)."""

from __future__ import annotations

import torch

from kernels._dispatch import use_triton


def _check_shapes(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                  value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    if key.shape != value.shape or key_cache.shape != value_cache.shape:
        raise ValueError(
            f"key/value shapes {tuple(key.shape)}/{tuple(value.shape)} and cache shapes "
            f"{tuple(key_cache.shape)}/{tuple(value_cache.shape)} must match pairwise"
        )
    if key.shape[1:] != key_cache.shape[2:]:
        raise ValueError(
            f"key [num_tokens, num_kv_heads, head_size] = {tuple(key.shape)} does not fit "
            f"cache [num_blocks, block_size, num_kv_heads, head_size] = {tuple(key_cache.shape)}"
        )
    if slot_mapping.shape[0] < key.shape[0]:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries, need >= {key.shape[0]} (num_tokens)"
        )


def reshape_and_cache_ref(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                          num_actual_tokens: int | None = None) -> None:
    """PyTorch reference of `reshape_and_cache` (same contract)."""
    _check_shapes(key, value, key_cache, value_cache, slot_mapping)
    if num_actual_tokens is not None and _can_copy_rows(key, value, key_cache, value_cache):
        # The real tokens are a prefix: one index_copy_ per cache, with no
        # padding mask (whose boolean indexing syncs on every layer).
        n = num_actual_tokens
        slots = slot_mapping[:n]
        row = key_cache.shape[2] * key_cache.shape[3]
        key_cache.view(-1, row).index_copy_(0, slots, key[:n].reshape(n, row))
        value_cache.view(-1, row).index_copy_(0, slots, value[:n].reshape(n, row))
        return
    slots = slot_mapping[: key.shape[0]]
    keep = slots >= 0
    slots = slots[keep]
    block_size = key_cache.shape[1]
    block_idx, block_offset = slots // block_size, slots % block_size
    key_cache[block_idx, block_offset] = key[keep].to(key_cache.dtype)
    value_cache[block_idx, block_offset] = value[keep].to(value_cache.dtype)


def _can_copy_rows(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor) -> bool:
    return (key_cache.is_contiguous() and value_cache.is_contiguous()
            and key.dtype == key_cache.dtype and value.dtype == value_cache.dtype)


def reshape_and_cache_triton(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                             value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Triton version of `reshape_and_cache` (see there for the contract)."""
    from kernels._triton.reshape_and_cache import launch_reshape_and_cache

    _check_shapes(key, value, key_cache, value_cache, slot_mapping)
    launch_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      num_actual_tokens: int | None = None) -> None:
    """Store key[t] / value[t] at `slot_mapping[t]` of the paged caches, in place.

    Args:
        key, value: [num_tokens, num_kv_heads, head_size].
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size]
            (e.g. `kv_cache[0]`, `kv_cache[1]`); slot s is `[s // block_size, s % block_size]`.
        slot_mapping: int64 [>= num_tokens]; -1 marks a padding token, which is skipped.
        num_actual_tokens: optional promise that tokens [0, num_actual_tokens)
            are the real ones and every later one is padding (as the model
            runner lays out a step); lets the CPU path skip the padding scan.

    Values are cast to the cache dtype. Slots not addressed are left bitwise untouched.
    Two real tokens must not share a slot (the scheduler never does that).
    """
    if use_triton(key):
        reshape_and_cache_triton(key, value, key_cache, value_cache, slot_mapping)
    else:
        reshape_and_cache_ref(key, value, key_cache, value_cache, slot_mapping, num_actual_tokens)
