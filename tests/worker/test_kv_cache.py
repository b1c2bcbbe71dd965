"""KV cache sizing and allocation."""

from __future__ import annotations

import pytest
import torch

from services.worker.kv_cache import KVCacheSpec, allocate_kv_caches, determine_num_blocks
from tests.cuda import needs_cuda

# SmolLM2-135M: 30 layers, 3 KV heads of 64.
SMOLLM2_SPEC = KVCacheSpec(
    block_size=16, num_kv_heads=3, head_size=64, dtype=torch.float32, num_layers=30
)


def test_page_size_bytes():
    # 2 (K and V) * 16 tokens * 3 heads * 64 * 4 bytes
    assert SMOLLM2_SPEC.page_size_bytes == 24_576
    assert SMOLLM2_SPEC.bytes_per_block == 737_280
    half = KVCacheSpec(16, 3, 64, torch.bfloat16, 30)
    assert half.page_size_bytes == 12_288


def test_cpu_num_blocks_from_gib():
    # 1 GiB / 737,280 bytes = 1456.35 -> 1456 blocks (null block included).
    assert determine_num_blocks(SMOLLM2_SPEC, torch.device("cpu"), cpu_kv_cache_gib=1.0) == 1456
    assert determine_num_blocks(SMOLLM2_SPEC, torch.device("cpu"), cpu_kv_cache_gib=0.25) == 364


def test_too_small_budget_raises():
    with pytest.raises(ValueError, match="at least 2 are needed"):
        determine_num_blocks(SMOLLM2_SPEC, torch.device("cpu"), cpu_kv_cache_gib=0.001)
    with pytest.raises(ValueError, match="kv_cache_gib must be > 0"):
        determine_num_blocks(SMOLLM2_SPEC, torch.device("cpu"), cpu_kv_cache_gib=0)


def test_allocate_shapes():
    spec = KVCacheSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16, num_layers=3)
    caches = allocate_kv_caches(spec, num_blocks=5, device=torch.device("cpu"))
    assert len(caches) == 3
    for cache in caches:
        assert cache.shape == (2, 5, 16, 2, 8)
        assert cache.dtype == torch.float16
        assert not cache.any()
    assert caches[0].data_ptr() != caches[1].data_ptr()
    with pytest.raises(ValueError, match="num_blocks must be >= 2"):
        allocate_kv_caches(spec, num_blocks=1, device=torch.device("cpu"))


@needs_cuda
def test_cuda_budget_uses_free_memory():
    free_bytes, _ = torch.cuda.mem_get_info()
    num_blocks = determine_num_blocks(SMOLLM2_SPEC, torch.device("cuda"), 0.5)
    assert num_blocks == int(free_bytes * 0.5) // SMOLLM2_SPEC.bytes_per_block
