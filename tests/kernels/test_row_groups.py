"""The linear kernels' row-group prefetch mode (kernels/row_groups.py): the same
bits in every mode, set for the process, and refused outside its range."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_extension, gguf_quants
from kernels.bf16_linear_cpu import bf16_linear
from kernels.gguf_linear_cpu import gguf_linear, gguf_linear_packed, pack_rows
from kernels.int8_dynamic_linear_cpu import weight_sums
from kernels.row_groups import PREFETCH_MODES, row_group_prefetch, set_row_group_prefetch

needs_prefetch_switch = pytest.mark.skipif(
    not cpu_extension.has_cpu_kernel("set_row_group_prefetch"),
    reason="kvmesh's C++ CPU kernels could not be built here")
pytestmark = needs_prefetch_switch


@pytest.fixture(autouse=True)
def restore_the_mode():
    """The process's mode as it was before the test."""
    before = row_group_prefetch()
    yield
    set_row_group_prefetch(before)


def _linears() -> list:
    """Calls of kernels that share the loop, on odd shapes (a last group of a few rows),
    with three activation rows and with one (the loops that prefetch "ahead")."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 128, generator=gen)
    weight = torch.randn(203, 128, generator=gen)
    q4_1 = gguf_quants.GGMLQuantizationType.Q4_1
    blocks = gguf_quants.quantize(weight[:200], q4_1)
    packed = pack_rows(blocks, q4_1)
    qweight = torch.randint(-127, 128, weight.shape, generator=gen, dtype=torch.int8)
    scales, sums = torch.rand(weight.shape[0], generator=gen), weight_sums(qweight)
    w8a8 = torch.ops.kvmesh.int8_dynamic_linear_cpu
    return [call for rows in (x, x[:1]) for call in (
        lambda rows=rows: bf16_linear(rows.bfloat16(), weight.bfloat16()),
        lambda rows=rows: bf16_linear(rows, weight.bfloat16()),
        lambda rows=rows: gguf_linear(rows, blocks, q4_1),
        lambda rows=rows: gguf_linear_packed(rows, packed, q4_1),
        *(lambda rows=rows, vnni=vnni: w8a8(rows, qweight, scales, sums, vnni)
          for vnni in (True, False)))]


@pytest.mark.parametrize("mode", PREFETCH_MODES)
def test_every_mode_gives_the_same_bits(mode: str):
    set_row_group_prefetch("whole_group")
    expected = [call() for call in _linears()]
    set_row_group_prefetch(mode)
    assert row_group_prefetch() == mode
    for call, out in zip(_linears(), expected):
        assert torch.equal(call(), out)


def test_a_mode_outside_the_range_is_refused():
    with pytest.raises(ValueError, match="whole_group, first_lines, none, ahead"):
        set_row_group_prefetch("all")
    with pytest.raises(RuntimeError, match="mode must be 0"):
        torch.ops.kvmesh.set_row_group_prefetch(len(PREFETCH_MODES))
    assert row_group_prefetch() in PREFETCH_MODES
