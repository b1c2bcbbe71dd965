"""compute_slot_mapping: exact slots from the block table, -1 for padding; the numpy
(CPU) and Triton versions == the reference."""

from __future__ import annotations

import pytest
import torch

from kernels import (
    PAD_SLOT_ID,
    compute_slot_mapping,
    compute_slot_mapping_cpu,
    compute_slot_mapping_ref,
    compute_slot_mapping_triton,
)
from tests.cuda import needs_cuda

IMPLS = [compute_slot_mapping_ref, compute_slot_mapping_cpu,
         pytest.param(compute_slot_mapping_triton, marks=pytest.mark.triton_cpu)]


def _batch(num_computed: list[int], num_scheduled: list[int], block_size: int,
           num_padding: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A block table of shuffled block ids, query_start_loc and positions (padding positions 0)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = [-(-(c + s) // block_size) for c, s in zip(num_computed, num_scheduled)]
    block_ids = torch.randperm(sum(num_blocks), generator=gen).to(torch.int32) + 1  # 0 = null block
    block_table = torch.zeros(len(num_computed) + 2, max(num_blocks) + 3, dtype=torch.int32)
    start = 0
    for row, n in enumerate(num_blocks):
        block_table[row, :n] = block_ids[start : start + n]
        start += n
    query_start_loc = torch.tensor([0] + num_scheduled, dtype=torch.int32).cumsum(0).to(torch.int32)
    positions = torch.cat([torch.arange(c, c + s) for c, s in zip(num_computed, num_scheduled)]
                          + [torch.zeros(num_padding, dtype=torch.int64)])
    return block_table, query_start_loc, positions


def _expected(block_table, query_start_loc, positions, block_size, num_actual_tokens):
    expected = torch.full_like(positions, PAD_SLOT_ID)
    for row in range(query_start_loc.numel() - 1):
        for t in range(int(query_start_loc[row]), int(query_start_loc[row + 1])):
            pos = int(positions[t])
            expected[t] = int(block_table[row, pos // block_size]) * block_size + pos % block_size
    assert int(query_start_loc[-1]) == num_actual_tokens
    return expected


@pytest.mark.parametrize("impl", IMPLS)
def test_seed_example(impl):
    # block_size 4, blocks [7, 3, 9], positions 6, 7, 8 -> slots 14, 15, 36 (seed 003 section 11).
    block_table = torch.tensor([[7, 3, 9, 0]], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 3], dtype=torch.int32)
    positions = torch.tensor([6, 7, 8, 0, 0], dtype=torch.int64)
    out = impl(block_table, query_start_loc, positions, 4, 1, 3)
    assert out.tolist() == [14, 15, 36, -1, -1]


@pytest.mark.parametrize("impl", IMPLS)
def test_mixed_batch_exact(impl):
    # Three requests scheduling [2, 5, 3] tokens after [0, 6, 17] computed ones, 2 padding tokens.
    block_table = torch.tensor([[5, 0, 0], [2, 8, 0], [4, 1, 6]], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 2, 7, 10], dtype=torch.int32)
    positions = torch.tensor([0, 1, 6, 7, 8, 9, 10, 17, 18, 19, 0, 0], dtype=torch.int64)
    out = torch.full((12,), 123, dtype=torch.int64)
    result = impl(block_table, query_start_loc, positions, 8, 3, 10, out=out)
    assert result.data_ptr() == out.data_ptr()
    assert out.tolist() == [40, 41, 22, 23, 64, 65, 66, 49, 50, 51, -1, -1]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_random_batches(impl, block_size):
    for seed in range(3):
        gen = torch.Generator().manual_seed(100 * block_size + seed)
        num_reqs = int(torch.randint(1, 9, (1,), generator=gen))
        num_computed = torch.randint(0, 70, (num_reqs,), generator=gen).tolist()
        num_scheduled = torch.randint(1, 40, (num_reqs,), generator=gen).tolist()
        num_scheduled[0] = 1  # always at least one decode-like request
        tables = _batch(num_computed, num_scheduled, block_size, num_padding=seed * 5, seed=seed)
        num_actual_tokens = sum(num_scheduled)
        expected = _expected(*tables, block_size, num_actual_tokens)
        out = impl(*tables, block_size, num_reqs, num_actual_tokens)
        assert torch.equal(out, expected)


@pytest.mark.triton_cpu
def test_dispatch_cpu_uses_numpy(monkeypatch):
    monkeypatch.delenv("KVMESH_FORCE_TRITON", raising=False)
    tables = _batch([3, 0], [1, 9], 16, num_padding=3, seed=7)
    calls = []
    monkeypatch.setattr("kernels.slot_mapping.compute_slot_mapping_cpu",
                        lambda *args, **kwargs: calls.append(1) or compute_slot_mapping_cpu(
                            *args, **kwargs))
    assert torch.equal(compute_slot_mapping(*tables, 16, 2, 10),
                       compute_slot_mapping_ref(*tables, 16, 2, 10))
    assert calls == [1]
    monkeypatch.setenv("KVMESH_FORCE_TRITON", "1")
    assert torch.equal(compute_slot_mapping(*tables, 16, 2, 10),
                       _expected(*tables, 16, 10))


@pytest.mark.parametrize("impl", [compute_slot_mapping_ref, compute_slot_mapping_cpu])
def test_no_actual_tokens_is_all_padding(impl):
    """A dummy run schedules tokens but writes none (``num_actual_tokens`` 0)."""
    tables = _batch([3, 0], [1, 9], 16, num_padding=2, seed=5)
    assert impl(*tables, 16, 2, 0).tolist() == [PAD_SLOT_ID] * 12


def test_out_too_small_is_rejected():
    tables = _batch([0], [4], 16, num_padding=0, seed=0)
    with pytest.raises(ValueError, match="at least 4"):
        compute_slot_mapping_ref(*tables, 16, 1, 4, out=torch.empty(3, dtype=torch.int64))


@needs_cuda
def test_cuda_matches_reference():
    tables = _batch([0, 40, 7, 300], [33, 1, 1, 64], 16, num_padding=6, seed=3)
    expected = compute_slot_mapping_ref(*tables, 16, 4, 99)
    out = compute_slot_mapping(*(t.cuda() for t in tables), 16, 4, 99)
    assert out.is_cuda and torch.equal(out.cpu(), expected)
