"""kvmesh::bf16_amx_linear_cpu (kernels/csrc) against its reference, F.linear on float32
copies of the operands, and amx_pack's layout against its definition."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.bf16_amx_linear_cpu import amx_pack, can_use_amx, has_amx

needs_amx = pytest.mark.skipif(not has_amx(), reason="this CPU has no AMX-BF16 (lscpu flag "
                               "amx_bf16), or Linux did not grant its tile state")


def _operands(num_rows: int, out_features: int, in_features: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, in_features, generator=gen).bfloat16()
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    return x, weight


def _assert_matches_reference(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """Exact products summed in float32 in another order, rounded once to bfloat16:
    at most the neighbouring value (1 ulp, < 2**-7 relative)."""
    expected = F.linear(x.float(), weight.float())
    assert out.dtype == torch.bfloat16 and out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected, rtol=2**-7,
                               atol=1e-5 * float(expected.abs().max()))


def test_amx_pack_lays_out_pairs_of_columns_across_sixteen_rows() -> None:
    """packed[n // 16, k // 32, (k % 32) // 2, n % 16, k % 2] == weight[n, k]."""
    weight = torch.arange(64 * 96, dtype=torch.float32).reshape(64, 96).bfloat16()
    packed = amx_pack(weight)
    assert packed.shape == (4, 3, 16, 16, 2) and packed.is_contiguous()
    for n, k in [(0, 0), (0, 1), (1, 0), (17, 33), (63, 95), (40, 64)]:
        assert packed[n // 16, k // 32, (k % 32) // 2, n % 16, k % 2] == weight[n, k]


def test_amx_pack_and_can_use_amx_refuse_other_shapes() -> None:
    with pytest.raises(ValueError, match=r"multiples of 32, got \(48, 64\)"):
        amx_pack(torch.zeros(48, 64, dtype=torch.bfloat16))
    assert not can_use_amx(torch.zeros(32, 48, dtype=torch.bfloat16))
    assert not can_use_amx(torch.zeros(32, 64))  # float32


@needs_amx
@pytest.mark.parametrize("num_rows", [1, 2, 15, 16, 17, 31, 32, 33, 64, 100, 257, 600])
@pytest.mark.parametrize(("out_features", "in_features"),
                         [(32, 32), (96, 64), (576, 576), (64, 1536)])
def test_matches_reference(num_rows: int, out_features: int, in_features: int) -> None:
    """Partial tiles of x (padded rows), one and two halves of a block, several
    256-row chunks, one and many tiles of K."""
    x, weight = _operands(num_rows, out_features, in_features, seed=num_rows)
    out = torch.ops.kvmesh.bf16_amx_linear_cpu(x, amx_pack(weight))
    _assert_matches_reference(out, x, weight)


@needs_amx
def test_a_strided_x_and_no_rows() -> None:
    x, weight = _operands(40, 64, 128, seed=3)
    packed = amx_pack(weight)
    columns = torch.cat([x, x], dim=1)[:, ::2]  # not contiguous: the kernel copies it
    _assert_matches_reference(torch.ops.kvmesh.bf16_amx_linear_cpu(columns, packed), columns,
                              weight)
    assert torch.ops.kvmesh.bf16_amx_linear_cpu(x[:0], packed).shape == (0, 64)


@needs_amx
def test_nan_and_inf_stay_in_their_rows() -> None:
    """A NaN or infinite activation poisons its own output row only; the rows of the
    same tiles around it are the reference's."""
    x, weight = _operands(20, 64, 96, seed=5)
    x[3, 10], x[17, 0] = float("nan"), float("inf")
    out = torch.ops.kvmesh.bf16_amx_linear_cpu(x, amx_pack(weight))
    assert out[3].isnan().all() and not out[17].isfinite().any()
    others = [i for i in range(20) if i not in (3, 17)]
    _assert_matches_reference(out[others], x[others], weight)


@needs_amx
def test_bad_operands_are_refused() -> None:
    x, weight = _operands(4, 64, 96, seed=0)
    packed = amx_pack(weight)
    with pytest.raises(RuntimeError, match=r"x must be bfloat16 \[M, K\], got Float"):
        torch.ops.kvmesh.bf16_amx_linear_cpu(x.float(), packed)
    with pytest.raises(RuntimeError, match=r"packed_weight must be amx_pack's .* got BFloat16 "
                                           r"\[64, 96\]"):
        torch.ops.kvmesh.bf16_amx_linear_cpu(x, weight)
    with pytest.raises(RuntimeError, match=r"N a multiple of 32, got BFloat16 \[1, 3, 16, 16, 2\]"):
        torch.ops.kvmesh.bf16_amx_linear_cpu(x, packed[:1].contiguous())
    with pytest.raises(RuntimeError, match=r"packed weight's K = 96, got \[4, 64\]"):
        torch.ops.kvmesh.bf16_amx_linear_cpu(x[:, :64], packed)
