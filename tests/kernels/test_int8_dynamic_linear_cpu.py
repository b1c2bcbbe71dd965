"""kvmesh::int8_dynamic_linear_cpu (kernels/csrc) on both its paths against the PyTorch
reference (bit for bit), the reference against float matmul within the bound that
per-token activation rounding allows, NaN / zero rows, the int32 limit on K,
refusals, and the fallback."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from kernels import cpu_extension, int8_dynamic_linear_cpu
from kernels.int8_dynamic_linear_cpu import (
    CPU_KERNEL_MAX_K,
    int8_dynamic_linear,
    int8_dynamic_linear_ref,
    quantize_activations_per_token,
    weight_sums,
)

needs_kernel = pytest.mark.skipif(not cpu_extension.has_cpu_kernel("int8_dynamic_linear_cpu"),
                                  reason="kvmesh's C++ kernels are not built on this machine")
# use_vnni=False forces the AVX2 path; on a CPU without AVX512-VNNI both run AVX2.
PATHS = pytest.mark.parametrize("use_vnni", [True, False], ids=["vnni", "avx2"])
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)


def _operands(num_tokens: int, out_features: int, in_features: int, dtype: torch.dtype,
              seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, in_features, generator=gen)
    x[-1, 1] = 40.0  # an outlier that coarsens its row
    qweight = torch.randint(-128, 128, (out_features, in_features), generator=gen,
                            dtype=torch.int8)
    scales = torch.rand(out_features, generator=gen) / 100
    return x.to(dtype), qweight, scales


def _op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
        use_vnni: bool = True) -> torch.Tensor:
    return torch.ops.kvmesh.int8_dynamic_linear_cpu(x, qweight, scales, weight_sums(qweight),
                                                    use_vnni)


@needs_kernel
@PATHS
@DTYPES
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 4, 5, 7, 8, 15, 16, 33, 64, 65, 100])
@pytest.mark.parametrize("out_features", [1, 7, 100, 576])
@pytest.mark.parametrize("in_features", [64, 576, 1536])
def test_kernel_is_the_reference_bit_for_bit(use_vnni: bool, dtype: torch.dtype,
                                             num_tokens: int, out_features: int,
                                             in_features: int) -> None:
    """Same int8 activations, exact integer products, the same float32 scaling in
    the same order: nothing is left to differ. Activation rows past the blocks of
    four, weight rows past the groups of four and the threads' split; from 16 rows
    on, the VNNI path's GEMM (rows past whole vectors and passes of 32, weight rows
    past its groups of six)."""
    x, qweight, scales = _operands(num_tokens, out_features, in_features, dtype,
                                   seed=num_tokens * 1000 + out_features + in_features)
    out = _op(x, qweight, scales, use_vnni)
    assert out.dtype == dtype and out.shape == (num_tokens, out_features)
    assert torch.isfinite(out).all()
    assert torch.equal(out, int8_dynamic_linear_ref(x, qweight, scales))


@needs_kernel
@PATHS
@pytest.mark.parametrize("num_tokens", [2, 17], ids=["rows", "gemm"])
def test_the_largest_k_does_not_overflow(use_vnni: bool, num_tokens: int) -> None:
    """At CPU_KERNEL_MAX_K (rounded down to whole vectors), the VNNI path's unsigned
    sum reaches 255 * -128 * K, just inside int32; one vector more is refused."""
    in_features = CPU_KERNEL_MAX_K // 64 * 64
    x = torch.ones(num_tokens, in_features)
    x[1::2] = -1.0
    qweight = torch.full((3, in_features), -128, dtype=torch.int8)
    qweight[1] = 127
    scales = torch.ones(3)
    out = _op(x, qweight, scales, use_vnni)
    assert torch.equal(out, int8_dynamic_linear_ref(x, qweight, scales))
    assert float(out[0, 0]) == pytest.approx(-128.0 * in_features, rel=1e-6)
    x, qweight = torch.ones(2, in_features + 64), torch.ones(3, in_features + 64, dtype=torch.int8)
    with pytest.raises(RuntimeError, match=f"at most {CPU_KERNEL_MAX_K} \\(int32 accumulation\\)"):
        _op(x, qweight, scales, use_vnni)


@needs_kernel
@PATHS
@DTYPES
@pytest.mark.parametrize("num_tokens", [6, 40], ids=["rows", "gemm"])
def test_a_nan_or_inf_spoils_its_own_row_only(use_vnni: bool, dtype: torch.dtype,
                                              num_tokens: int) -> None:
    x, qweight, scales = _operands(num_tokens, 37, 576, dtype, seed=1)
    clean = _op(x, qweight, scales, use_vnni)
    assert torch.equal(clean, _op(x, qweight, scales, use_vnni))  # every output written
    x[1, 40] = torch.nan
    x[3, 2] = -torch.inf
    x[4, 575] = torch.inf
    out = _op(x, qweight, scales, use_vnni)
    assert out[[1, 3, 4]].isnan().all()
    kept = [m for m in range(num_tokens) if m not in (1, 3, 4)]
    assert torch.equal(out[kept], clean[kept])
    torch.testing.assert_close(out, int8_dynamic_linear_ref(x, qweight, scales), rtol=0, atol=0,
                               equal_nan=True)


@needs_kernel
@PATHS
@DTYPES
def test_zero_rows_give_zeros(use_vnni: bool, dtype: torch.dtype) -> None:
    """An all-zero row (and one too small to scale: subnormals) multiplies as zeros."""
    x, qweight, scales = _operands(5, 37, 128, dtype, seed=2)
    x[0] = 0.0
    x[3] = 1e-39 if dtype == torch.float32 else 0.0
    out = _op(x, qweight, scales, use_vnni)
    assert not out[[0, 3]].any()
    assert torch.equal(out, int8_dynamic_linear_ref(x, qweight, scales))
    assert out[[1, 2, 4]].all()


@needs_kernel
def test_bad_operands_are_refused() -> None:
    x, qweight, scales = _operands(2, 8, 64, torch.float32, seed=3)
    sums = weight_sums(qweight)
    op = torch.ops.kvmesh.int8_dynamic_linear_cpu
    with pytest.raises(RuntimeError, match="K=96 must be a multiple of 64"):
        op(torch.randn(2, 96), torch.ones(8, 96, dtype=torch.int8), scales, sums)
    with pytest.raises(RuntimeError, match="qweight has K=128, x has K=64"):
        op(x, torch.ones(8, 128, dtype=torch.int8), scales, sums)
    with pytest.raises(RuntimeError, match="x must be a contiguous float32 or bfloat16"):
        op(x.half(), qweight, scales, sums)
    with pytest.raises(RuntimeError, match="x must be a contiguous float32 or bfloat16"):
        op(torch.randn(64, 2).T, qweight, scales, sums)
    with pytest.raises(RuntimeError, match="qweight must be a contiguous int8"):
        op(x, qweight.view(torch.uint8), scales, sums)
    with pytest.raises(RuntimeError, match=r"scales must be a contiguous float32 \[N=8\]"):
        op(x, qweight, scales.bfloat16(), sums)
    with pytest.raises(RuntimeError, match=r"weight_sums must be a contiguous int32 \[N=8\]"):
        op(x, qweight, scales, sums.long())
    with pytest.raises(RuntimeError, match=r"weight_sums must be a contiguous int32 \[N=8\]"):
        op(x, qweight, scales, sums[:7])


@needs_kernel
def test_fake_kernel_gives_the_output_shape() -> None:
    """What torch.compile traces with (kernels.cpu_extension._register_fake_kernels)."""
    x, qweight, scales = _operands(3, 40, 64, torch.bfloat16, seed=4)
    sums = weight_sums(qweight)
    with FakeTensorMode() as mode:
        out = torch.ops.kvmesh.int8_dynamic_linear_cpu(
            *(mode.from_tensor(t) for t in (x, qweight, scales, sums)))
    assert out.shape == (3, 40) and out.dtype == torch.bfloat16


@DTYPES
def test_without_the_kernel_the_reference_serves(monkeypatch: pytest.MonkeyPatch,
                                                 dtype: torch.dtype) -> None:
    x, qweight, scales = _operands(3, 40, 128, dtype, seed=5)
    with_kernel = int8_dynamic_linear(x, qweight, scales, weight_sums(qweight))
    monkeypatch.setattr(int8_dynamic_linear_cpu, "has_cpu_kernel", lambda name: False)
    out = int8_dynamic_linear(x, qweight, scales, weight_sums(qweight))
    assert torch.equal(out, int8_dynamic_linear_ref(x, qweight, scales))
    assert torch.equal(out, with_kernel)


def test_a_k_the_kernel_cannot_take_takes_the_reference() -> None:
    x, qweight, scales = _operands(3, 40, 96, torch.float32, seed=6)
    assert torch.equal(int8_dynamic_linear(x, qweight, scales, weight_sums(qweight)),
                       int8_dynamic_linear_ref(x, qweight, scales))


@DTYPES
def test_activation_quantization_is_int8_per_token(dtype: torch.dtype) -> None:
    x, _, _ = _operands(4, 1, 576, dtype, seed=7)
    q, s = quantize_activations_per_token(x)
    xf = x.float()
    assert q.dtype == torch.int8 and s.shape == (4,)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    torch.testing.assert_close(s, xf.abs().amax(dim=1) / 127, rtol=0, atol=0)
    # Rounding moves each element by at most half a step (and an ulp of the product).
    assert ((q.float() * s[:, None] - xf).abs() <= s[:, None] * (0.5 + 1e-5)).all()


@DTYPES
def test_reference_is_float_matmul_within_activation_rounding(dtype: torch.dtype) -> None:
    """Rounding x to int8 moves each element by at most s_x / 2, so
    |out - x @ W.T| <= s_x / 2 * sum_k |W[n, k]| for W = qweight * scales."""
    x, qweight, scales = _operands(5, 300, 1536, dtype, seed=8)
    weight = qweight.float() * scales[:, None]
    _, s = quantize_activations_per_token(x)
    bound = s[:, None] / 2 * weight.abs().sum(dim=1)[None, :]
    out = int8_dynamic_linear_ref(x, qweight, scales).float()
    exact = x.float() @ weight.T
    slack = 1e-5 * float(exact.abs().max()) + (0 if dtype == torch.float32 else 2**-8) * exact.abs()
    assert ((out - exact).abs() <= bound + slack).all()
    assert float((out - exact).abs().max()) > 0  # the activations were quantized
