"""kvmesh::int8_linear_cpu (kernels/csrc, AVX-512 builds) against its reference,
torch._weight_int8pack_mm, and the fallback to it."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_extension, int8_linear_cpu
from kernels.int8_linear_cpu import int8_linear

pytestmark = pytest.mark.skipif(not cpu_extension.has_cpu_kernel("int8_linear_cpu"),
                                reason="kvmesh's int8 kernel is built for AVX-512 CPUs only")


def _operands(num_rows: int, out_features: int, in_features: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, in_features, generator=gen).to(dtype)
    qweight = torch.randint(-127, 128, (out_features, in_features), generator=gen, dtype=torch.int8)
    scales = (torch.rand(out_features, generator=gen) / 100).to(dtype)
    return x, qweight, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 6, 9, 31])
@pytest.mark.parametrize(("out_features", "in_features"), [(37, 64), (576, 1536), (960, 576)])
def test_kernel_matches_int8pack(dtype: torch.dtype, num_rows: int, out_features: int,
                                 in_features: int) -> None:
    """Rows past the last group of eight, several activation rows, both dtypes."""
    x, qweight, scales = _operands(num_rows, out_features, in_features, dtype, seed=num_rows)
    out = torch.ops.kvmesh.int8_linear_cpu(x, qweight, scales)
    expected = torch._weight_int8pack_mm(x, qweight, scales)
    assert out.dtype == dtype and out.shape == expected.shape
    # Both sum in float32 (in another order); bfloat16 rounds the output.
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, expected, atol=tolerance * float(expected.abs().max()), rtol=0)


def test_bad_operands_are_refused() -> None:
    x, qweight, scales = _operands(2, 8, 24, torch.float32, seed=0)
    with pytest.raises(RuntimeError, match="K a multiple of 16"):
        torch.ops.kvmesh.int8_linear_cpu(x, qweight, scales)
    x, qweight, scales = _operands(2, 8, 32, torch.float32, seed=0)
    with pytest.raises(RuntimeError, match="scales must be \\[N\\] in x's dtype"):
        torch.ops.kvmesh.int8_linear_cpu(x, qweight, scales.bfloat16())


def test_without_the_kernel_torch_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    x, qweight, scales = _operands(2, 40, 64, torch.bfloat16, seed=1)
    monkeypatch.setattr(int8_linear_cpu, "has_cpu_kernel", lambda name: False)
    assert torch.equal(int8_linear(x, qweight, scales), torch._weight_int8pack_mm(x, qweight, scales))
