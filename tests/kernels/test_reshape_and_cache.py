"""reshape_and_cache: K/V land at their slots, -1 is skipped, everything else stays bitwise untouched."""

from __future__ import annotations

import pytest
import torch

from kernels import reshape_and_cache, reshape_and_cache_ref, reshape_and_cache_triton
from tests.cuda import needs_cuda

IMPLS = [reshape_and_cache_ref,
         pytest.param(reshape_and_cache_triton, marks=pytest.mark.triton_cpu)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _case(num_tokens: int, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
          dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=gen).to(dtype)
    key = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    # Distinct slots outside the null block, every third token a padding token.
    slots = torch.randperm((num_blocks - 1) * block_size, generator=gen)[:num_tokens] + block_size
    slots[::3] = -1
    return kv_cache, key, value, slots


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def _expected(kv_cache, key, value, slots):
    expected = kv_cache.clone()
    block_size = kv_cache.shape[2]
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[0, slot // block_size, slot % block_size] = key[t]
            expected[1, slot // block_size, slot % block_size] = value[t]
    return expected


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,num_kv_heads,head_size", [(8, 1, 32), (16, 3, 64), (32, 4, 32)])
def test_writes_exactly_the_addressed_slots(impl, dtype, block_size, num_kv_heads, head_size):
    kv_cache, key, value, slots = _case(13, 6, block_size, num_kv_heads, head_size, dtype, seed=block_size)
    expected = _expected(kv_cache, key, value, slots)
    impl(key, value, kv_cache[0], kv_cache[1], slots)
    # Bitwise: written slots hold the inputs, every other slot (incl. the null block) is unchanged.
    assert torch.equal(_bits(kv_cache), _bits(expected))


@pytest.mark.parametrize("impl", IMPLS)
def test_seed_example_slots(impl):
    # Slots 14, 15, 36 of seed 003 with block_size 4: blocks 3 (offsets 2, 3) and 9 (offset 0).
    kv_cache = torch.zeros(2, 10, 4, 1, 32)
    key = torch.arange(3 * 32, dtype=torch.float32).view(3, 1, 32) + 1
    impl(key, -key, kv_cache[0], kv_cache[1], torch.tensor([14, 15, 36, -1]))
    assert torch.equal(kv_cache[0, 3, 2, 0], key[0, 0]) and torch.equal(kv_cache[0, 3, 3, 0], key[1, 0])
    assert torch.equal(kv_cache[1, 9, 0, 0], -key[2, 0])
    assert int((kv_cache != 0).sum()) == 2 * 3 * 32


@pytest.mark.parametrize("impl", IMPLS)
def test_casts_to_cache_dtype(impl):
    kv_cache = torch.zeros(2, 3, 8, 2, 32, dtype=torch.bfloat16)
    # float32 values that bf16 holds exactly: the Triton interpreter rounds toward zero
    # where CUDA rounds to nearest even, so only exact values compare across both.
    key = torch.randn(2, 2, 32).to(torch.bfloat16).float()
    impl(key, key, kv_cache[0], kv_cache[1], torch.tensor([8, 23]))
    assert torch.equal(kv_cache[0, 1, 0], key[0].to(torch.bfloat16))
    assert torch.equal(kv_cache[1, 2, 7], key[1].to(torch.bfloat16))


@pytest.mark.parametrize("impl", IMPLS)
def test_key_value_sliced_from_fused_qkv(impl):
    kv_cache, key, value, slots = _case(9, 5, 8, 2, 32, torch.float32, seed=3)
    expected = _expected(kv_cache, key, value, slots)
    qkv = torch.cat([torch.randn(9, 4 * 32), key.view(9, -1), value.view(9, -1)], dim=1)
    key_view, value_view = qkv[:, 4 * 32 : 6 * 32].view(9, 2, 32), qkv[:, 6 * 32 :].view(9, 2, 32)
    impl(key_view, value_view, kv_cache[0], kv_cache[1], slots)
    assert torch.equal(_bits(kv_cache), _bits(expected))


def test_shape_mismatch_is_rejected():
    kv_cache = torch.zeros(2, 3, 8, 2, 32)
    with pytest.raises(ValueError, match="does not fit"):
        reshape_and_cache(torch.zeros(1, 3, 32), torch.zeros(1, 3, 32), kv_cache[0], kv_cache[1],
                          torch.tensor([0]))


@pytest.mark.triton_cpu
def test_dispatch_force_triton(monkeypatch):
    monkeypatch.setenv("KVMESH_FORCE_TRITON", "1")
    kv_cache, key, value, slots = _case(7, 4, 16, 3, 64, torch.float32, seed=1)
    expected = _expected(kv_cache, key, value, slots)
    reshape_and_cache(key, value, kv_cache[0], kv_cache[1], slots)
    assert torch.equal(kv_cache, expected)


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_matches_expected(dtype):
    kv_cache, key, value, slots = _case(50, 20, 16, 3, 64, dtype, seed=5)
    expected = _expected(kv_cache, key, value, slots)
    kv_cuda = kv_cache.cuda()
    reshape_and_cache(key.cuda(), value.cuda(), kv_cuda[0], kv_cuda[1], slots.cuda())
    assert torch.equal(kv_cuda.cpu(), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefix_of_real_tokens_path_equals_the_general_path(dtype):
    """num_actual_tokens (real tokens first, padding after) writes what the mask path writes."""
    gen = torch.Generator().manual_seed(3)
    num_blocks, block_size, kv_heads, head_size, num_tokens, num_real = 9, 8, 3, 16, 12, 9
    key = torch.randn(num_tokens, kv_heads, head_size, generator=gen).to(dtype)
    value = torch.randn(num_tokens, kv_heads, head_size, generator=gen).to(dtype)
    slots = torch.randperm((num_blocks - 1) * block_size, generator=gen)[:num_real] + block_size
    slot_mapping = torch.cat([slots, torch.full((num_tokens - num_real,), -1)]).to(torch.int64)
    caches = [torch.randn(2, num_blocks, block_size, kv_heads, head_size, generator=gen).to(dtype)
              for _ in range(2)]
    expected, actual = caches[0], caches[0].clone()
    reshape_and_cache_ref(key, value, expected[0], expected[1], slot_mapping)
    reshape_and_cache_ref(key, value, actual[0], actual[1], slot_mapping, num_actual_tokens=num_real)
    assert torch.equal(actual, expected)
