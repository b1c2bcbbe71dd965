"""kvmesh::gguf_linear_cpu (kernels/csrc) on both its paths against the PyTorch
reference with the same int8 activations, against float matmul within the bound
activation quantization allows, the fallback, and kernels.gguf_quants against the
gguf package's own quantizers."""

from __future__ import annotations

import functools

import gguf
import numpy as np
import pytest
import torch

from kernels import cpu_extension, gguf_linear_cpu, gguf_quants
from kernels.gguf_linear_cpu import gguf_linear, gguf_linear_ref, quantize_activations
from kernels.gguf_quants import GGMLQuantizationType

QUANT_TYPES = list(GGMLQuantizationType)
needs_kernel = pytest.mark.skipif(not cpu_extension.has_cpu_kernel("gguf_linear_cpu"),
                                  reason="kvmesh's C++ kernels are not built on this machine")
# use_vnni=False forces the AVX2 path; on a CPU without AVX512-VNNI both run AVX2.
PATHS = pytest.mark.parametrize("use_vnni", [True, False], ids=["vnni", "avx2"])


@functools.cache
def _weight(quant_type: GGMLQuantizationType, num_rows: int, num_cols: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(num_rows * 7919 + num_cols + int(quant_type))
    weight = torch.randn(num_rows, num_cols, generator=gen) * 0.05
    weight[0, :32] = 0  # an all-zero block
    return gguf_quants.quantize(weight, quant_type)


def _x(num_rows: int, num_cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, num_cols, generator=gen)
    x[0, 32:64] = 0  # a block quantized to zeros
    x[-1, 1] = 40.0  # an outlier that coarsens its block
    return x.to(dtype)


def _gguf_type(quant_type: GGMLQuantizationType) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType(int(quant_type))


@pytest.mark.parametrize("quant_type", QUANT_TYPES)
def test_blocks_are_gguf_blocks(quant_type: GGMLQuantizationType) -> None:
    """quantize writes the gguf package's bytes; dequantize reads them as it does."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(37, 96, generator=gen)
    weight[1, :32] = 0
    weight[2, 40] = -25.0
    assert _gguf_type(quant_type).name == quant_type.name
    block_bytes = gguf_quants.BLOCK_BYTES[quant_type]
    assert gguf.GGML_QUANT_SIZES[_gguf_type(quant_type)] == (32, block_bytes)
    qweight = gguf_quants.quantize(weight, quant_type)
    expected = gguf.quants.quantize(weight.numpy(), _gguf_type(quant_type))
    assert qweight.shape == (37, gguf_quants.row_bytes(quant_type, 96))
    np.testing.assert_array_equal(qweight.numpy(), expected)
    np.testing.assert_array_equal(gguf_quants.dequantize(qweight, quant_type, 96).numpy(),
                                  gguf.quants.dequantize(expected, _gguf_type(quant_type)))


# K = 544: 17 blocks, an odd one after 8 pairs.
SHAPES = [(37, 64), (37, 544), (576, 576), (1536, 576), (576, 1536)]


@needs_kernel
@PATHS
@pytest.mark.parametrize("quant_type", QUANT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 4, 5, 8, 17])
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_kernel_matches_reference(use_vnni: bool, quant_type: GGMLQuantizationType,
                                  dtype: torch.dtype, num_tokens: int, out_features: int,
                                  in_features: int) -> None:
    """Same int8 activations, same integer products: only float32 summation order
    differs (and, for bfloat16, which way the output rounds)."""
    qweight = _weight(quant_type, out_features, in_features)
    x = _x(num_tokens, in_features, dtype, seed=num_tokens)
    out = torch.ops.kvmesh.gguf_linear_cpu(x, qweight, int(quant_type), use_vnni)
    expected = gguf_linear_ref(x, qweight, quant_type)
    assert out.dtype == dtype and out.shape == (num_tokens, out_features)
    assert torch.isfinite(out).all()
    scale = float(expected.float().abs().max())
    rtol = 0 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-6 * scale, rtol=rtol)


@needs_kernel
@PATHS
@pytest.mark.parametrize("quant_type", QUANT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernel_is_float_matmul_within_activation_rounding(
        use_vnni: bool, quant_type: GGMLQuantizationType, dtype: torch.dtype) -> None:
    """Rounding x to int8 moves each element by at most d_x / 2 (d_x = its block's
    absmax / 127), so |out - x @ W.T| <= |W| @ (d_x / 2) per output."""
    qweight = _weight(quant_type, 576, 1536)
    x = _x(5, 1536, dtype, seed=3)
    weight = gguf_quants.dequantize(qweight, quant_type, 1536)
    half_step = (x.float().reshape(5, -1, 32).abs().amax(-1, keepdim=True) / 254).expand(-1, -1, 32)
    bound = half_step.reshape(5, -1) @ weight.abs().T
    out = torch.ops.kvmesh.gguf_linear_cpu(x, qweight, int(quant_type), use_vnni).float()
    exact = x.float() @ weight.T
    slack = 1e-5 * float(exact.abs().max()) + (0 if dtype == torch.float32 else 2**-7) * exact.abs()
    assert ((out - exact).abs() <= bound + slack).all()
    assert float((out - exact).abs().max()) > 0  # the activations were quantized


@needs_kernel
@PATHS
@pytest.mark.parametrize("quant_type", QUANT_TYPES, ids=lambda t: t.name)
def test_every_output_is_written_and_rows_are_independent(
        use_vnni: bool, quant_type: GGMLQuantizationType) -> None:
    """A NaN or an infinity spoils its own row (as in the reference), no other; the
    remaining outputs are the same on every call."""
    qweight = _weight(quant_type, 37, 64)
    x = _x(5, 64, torch.float32, seed=1)
    def op(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.kvmesh.gguf_linear_cpu(x, qweight, int(quant_type), use_vnni)

    clean = op(x)
    assert torch.isfinite(clean).all()
    assert torch.equal(clean, op(x))
    x[1, 40] = torch.nan
    x[3, 2] = -torch.inf
    out = op(x)
    assert out[[1, 3]].isnan().all()
    assert gguf_linear_ref(x, qweight, quant_type)[[1, 3]].isnan().all()
    assert torch.equal(out[[0, 2, 4]], clean[[0, 2, 4]])


def test_activation_quantization_is_int8_per_block() -> None:
    x = _x(3, 96, torch.float32, seed=2)
    xq = quantize_activations(x).reshape(3, -1, 32)
    d = x.reshape(3, -1, 32).abs().amax(-1, keepdim=True) / 127
    q = torch.where(d == 0, 0, xq / torch.where(d == 0, 1, d))
    assert torch.allclose(q, q.round(), atol=1e-4) and float(q.abs().max()) <= 127.0001
    assert float((xq.reshape(3, -1) - x).abs().max()) <= float(d.max()) / 2 * 1.0001


@pytest.mark.parametrize("quant_type", QUANT_TYPES, ids=lambda t: t.name)
def test_without_the_kernel_the_reference_serves(monkeypatch: pytest.MonkeyPatch,
                                                 quant_type: GGMLQuantizationType) -> None:
    qweight = _weight(quant_type, 37, 64)
    x = _x(3, 64, torch.bfloat16, seed=4)
    with_kernel = gguf_linear(x, qweight, quant_type)
    monkeypatch.setattr(gguf_linear_cpu, "has_cpu_kernel", lambda name: False)
    out = gguf_linear(x, qweight, quant_type)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, gguf_linear_ref(x, qweight, quant_type))
    torch.testing.assert_close(out.float(), with_kernel.float(), rtol=2**-7,
                               atol=1e-5 * float(out.float().abs().max()))


@needs_kernel
def test_bad_operands_are_refused() -> None:
    qweight = _weight(GGMLQuantizationType.Q4_1, 8, 64)
    op = torch.ops.kvmesh.gguf_linear_cpu
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match=r"quant_type must be 2 \(Q4_0\), 3 \(Q4_1\) or 8"):
        op(x, qweight, 12)
    with pytest.raises(RuntimeError, match="qweight has 40 bytes per row; K=64 needs 36"):
        op(x, qweight, int(GGMLQuantizationType.Q4_0))
    with pytest.raises(RuntimeError, match="qweight must be a contiguous uint8"):
        op(x, qweight.view(torch.int8), int(GGMLQuantizationType.Q4_1))
    with pytest.raises(RuntimeError, match="x's K=48 must be a multiple of 32"):
        op(torch.randn(2, 48), qweight[:, :30], int(GGMLQuantizationType.Q4_1))
    with pytest.raises(RuntimeError, match="x must be a contiguous float32 or bfloat16"):
        op(x.half(), qweight, int(GGMLQuantizationType.Q4_1))
    with pytest.raises(RuntimeError, match="x must be a contiguous float32 or bfloat16"):
        op(torch.randn(64, 2).T, qweight, int(GGMLQuantizationType.Q4_1))
