"""kvmesh::bf16_linear_cpu (kernels/csrc) against its reference, F.linear on float32
copies of the operands, on every path this build and CPU can run, and the fallback."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from kernels import bf16_linear_cpu, cpu_extension
from kernels.bf16_linear_cpu import bf16_linear

needs_kernel = pytest.mark.skipif(not cpu_extension.has_cpu_kernel("bf16_linear_cpu"),
                                  reason="kvmesh's CPU kernels are built for AVX-512 and AVX2")


def _skip_unless_runnable(path: str) -> None:
    """The kernel's forced paths: avx2 in every build, avx512f and avx512bf16 in
    AVX-512 builds, avx512bf16 only on CPUs with AVX512-BF16."""
    if path != "avx2" and torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip(f"path {path} is compiled into AVX-512 builds only")
    if path == "avx512bf16" and not torch.cpu._is_avx512_bf16_supported():
        pytest.skip("this CPU has no AVX512-BF16 (lscpu flag avx512_bf16): vdpbf16ps cannot run")


def _operands(num_rows: int, out_features: int, in_features: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, in_features, generator=gen).to(dtype)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    return x, weight


def _assert_matches_reference(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    expected = F.linear(x.float(), weight.float())
    assert out.dtype == x.dtype and out.shape == expected.shape
    # The products are exact in float32 and only the summation order differs; a
    # bfloat16 output may then round to the neighbouring value (1 ulp, < 2**-7 relative).
    rtol = 0 if x.dtype == torch.float32 else 2**-7
    torch.testing.assert_close(out.float(), expected, rtol=rtol,
                               atol=1e-5 * float(expected.abs().max()))


@needs_kernel
@pytest.mark.parametrize(("path", "dtype"), [
    ("avx512bf16", torch.bfloat16),  # bfloat16 x only (refusal of float32 tested below)
    ("avx512f", torch.float32), ("avx512f", torch.bfloat16),
    ("avx2", torch.float32), ("avx2", torch.bfloat16)])
@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 8, 17])
@pytest.mark.parametrize(("out_features", "in_features"),
                         [(37, 64), (576, 576), (1536, 576), (576, 1536)])
def test_each_path_matches_reference(path: str, dtype: torch.dtype, num_rows: int,
                                     out_features: int, in_features: int) -> None:
    """Rows past the last group of eight, blocks of activation rows and a partial
    one, both dtypes."""
    _skip_unless_runnable(path)
    x, weight = _operands(num_rows, out_features, in_features, dtype, seed=num_rows)
    _assert_matches_reference(torch.ops.kvmesh.bf16_linear_cpu(x, weight, path), x, weight)


@functools.cache
def _vocab_weight() -> torch.Tensor:
    return _operands(1, 49152, 576, torch.bfloat16, seed=0)[1]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lm_head_sized_weight(dtype: torch.dtype) -> None:
    """The model's largest weight (49152 x 576, the LM head) at one row, as decode
    runs it: the path the kernel picks itself."""
    weight = _vocab_weight()
    x = _operands(1, 1, 576, dtype, seed=1)[0]
    _assert_matches_reference(bf16_linear(x, weight), x, weight)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_stays_in_its_row(dtype: torch.dtype) -> None:
    """Every output element is written from its own rows only: a NaN in one row of x
    (inside a block of four, with a fifth row in the next block) fills that row of
    the output and no other."""
    x, weight = _operands(5, 44, 96, dtype, seed=2)
    x[2, 17] = float("nan")
    out = torch.ops.kvmesh.bf16_linear_cpu(x, weight)
    assert out[2].isnan().all()
    others = [0, 1, 3, 4]
    assert out[others].isfinite().all()
    _assert_matches_reference(out[others], x[others], weight)


@needs_kernel
def test_meta_kernel_gives_the_output_shape() -> None:
    """torch.compile traces the op with fake tensors, which run its Meta kernel."""
    x, weight = _operands(3, 40, 64, torch.bfloat16, seed=3)
    out = torch.ops.kvmesh.bf16_linear_cpu(x.to("meta"), weight.to("meta"))
    assert out.device.type == "meta" and out.shape == (3, 40) and out.dtype == torch.bfloat16


@needs_kernel
def test_bad_operands_are_refused() -> None:
    op = torch.ops.kvmesh.bf16_linear_cpu
    x, weight = _operands(2, 8, 48, torch.float32, seed=0)
    with pytest.raises(RuntimeError, match="share K, a multiple of 32"):
        op(x, weight)
    x, weight = _operands(2, 8, 64, torch.float32, seed=0)
    with pytest.raises(RuntimeError, match="share K, a multiple of 32"):
        op(x[:, :32], weight)
    with pytest.raises(RuntimeError, match="weight must be contiguous bfloat16"):
        op(x, weight.float())
    with pytest.raises(RuntimeError, match="weight must be contiguous bfloat16"):
        op(x, torch.cat([weight, weight], dim=1)[:, ::2])
    with pytest.raises(RuntimeError, match="x must be float32 or bfloat16"):
        op(x.half(), weight)
    with pytest.raises(RuntimeError, match="unknown path 'avx1024'"):
        op(x, weight, "avx1024")
    if torch.backends.cpu.get_cpu_capability() == "AVX512":
        with pytest.raises(RuntimeError, match="path avx512bf16 needs bfloat16 x"):
            op(x, weight, "avx512bf16")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_the_kernel_torch_serves(dtype: torch.dtype,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    x, weight = _operands(3, 40, 64, dtype, seed=1)
    monkeypatch.setattr(bf16_linear_cpu, "has_cpu_kernel", lambda name: False)
    out = bf16_linear(x, weight)
    assert torch.equal(out, F.linear(x, weight.to(dtype)))
    _assert_matches_reference(out, x, weight)


def test_k_off_the_kernel_multiple_is_served_by_torch() -> None:
    x, weight = _operands(2, 40, 48, torch.bfloat16, seed=4)
    assert torch.equal(bf16_linear(x, weight), F.linear(x, weight))
