"""kvmesh::gguf_linear_cpu (kernels/csrc) on both its paths against the PyTorch
reference with the same int8 activations, against float matmul within the bound
activation quantization allows, the fallback, and kernels.gguf_quants against the
gguf package's own quantizers."""

from __future__ import annotations

import functools
from collections.abc import Callable

import gguf
import numpy as np
import pytest
import torch

from kernels import cpu_extension, gguf_linear_cpu, gguf_quants
from kernels.gguf_linear_cpu import (
    PACK_ROWS,
    gguf_linear,
    gguf_linear_packed,
    gguf_linear_ref,
    pack_rows,
    quantize_activations,
    unpack_rows,
)
from kernels.gguf_quants import GGMLQuantizationType

QUANT_TYPES = list(GGMLQuantizationType)
needs_kernel = pytest.mark.skipif(not cpu_extension.has_cpu_kernel("gguf_linear_cpu"),
                                  reason="kvmesh's C++ kernels are not built on this machine")
# The file's rows and the rows packed by eight (gguf_linear_packed_cpu), each on
# either path (use_vnni=False forces AVX2; on a CPU without AVX512-VNNI both run AVX2).
KERNELS = pytest.mark.parametrize("kernel", ["vnni", "avx2", "packed vnni", "packed avx2"])


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


def _op(kernel: str, qweight: torch.Tensor, quant_type: GGMLQuantizationType
        ) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> x @ W.T by ``kernel`` on ``qweight`` (the file's rows; packed here for the
    "packed" kernels)."""
    use_vnni = kernel.endswith("vnni")
    if kernel.startswith("packed"):
        packed = pack_rows(qweight, quant_type)
        return lambda x: torch.ops.kvmesh.gguf_linear_packed_cpu(x, packed, int(quant_type),
                                                                 use_vnni)
    return lambda x: torch.ops.kvmesh.gguf_linear_cpu(x, qweight, int(quant_type), use_vnni)


def _rows(kernel: str, out_features: int) -> int:
    """``out_features``, rounded up to whole groups of eight for the packed kernels."""
    if kernel.startswith("packed"):
        return -(-out_features // PACK_ROWS) * PACK_ROWS
    return out_features


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
@KERNELS
@pytest.mark.parametrize("quant_type", QUANT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 4, 5, 8, 17])
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_kernel_matches_reference(kernel: str, quant_type: GGMLQuantizationType,
                                  dtype: torch.dtype, num_tokens: int, out_features: int,
                                  in_features: int) -> None:
    """Same int8 activations, same integer products: only float32 summation order
    differs (and, for bfloat16, which way the output rounds)."""
    out_features = _rows(kernel, out_features)
    qweight = _weight(quant_type, out_features, in_features)
    x = _x(num_tokens, in_features, dtype, seed=num_tokens)
    out = _op(kernel, qweight, quant_type)(x)
    expected = gguf_linear_ref(x, qweight, quant_type)
    assert out.dtype == dtype and out.shape == (num_tokens, out_features)
    assert torch.isfinite(out).all()
    scale = float(expected.float().abs().max())
    rtol = 0 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-6 * scale, rtol=rtol)


@needs_kernel
@KERNELS
@pytest.mark.parametrize("quant_type", QUANT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernel_is_float_matmul_within_activation_rounding(
        kernel: str, quant_type: GGMLQuantizationType, dtype: torch.dtype) -> None:
    """Rounding x to int8 moves each element by at most d_x / 2 (d_x = its block's
    absmax / 127), so |out - x @ W.T| <= |W| @ (d_x / 2) per output."""
    qweight = _weight(quant_type, 576, 1536)
    x = _x(5, 1536, dtype, seed=3)
    weight = gguf_quants.dequantize(qweight, quant_type, 1536)
    half_step = (x.float().reshape(5, -1, 32).abs().amax(-1, keepdim=True) / 254).expand(-1, -1, 32)
    bound = half_step.reshape(5, -1) @ weight.abs().T
    out = _op(kernel, qweight, quant_type)(x).float()
    exact = x.float() @ weight.T
    slack = 1e-5 * float(exact.abs().max()) + (0 if dtype == torch.float32 else 2**-7) * exact.abs()
    assert ((out - exact).abs() <= bound + slack).all()
    assert float((out - exact).abs().max()) > 0  # the activations were quantized


@needs_kernel
@KERNELS
@pytest.mark.parametrize("quant_type", QUANT_TYPES, ids=lambda t: t.name)
def test_every_output_is_written_and_rows_are_independent(
        kernel: str, quant_type: GGMLQuantizationType) -> None:
    """A NaN or an infinity spoils its own row (as in the reference), no other; the
    remaining outputs are the same on every call."""
    qweight = _weight(quant_type, _rows(kernel, 37), 64)
    x = _x(5, 64, torch.float32, seed=1)
    op = _op(kernel, qweight, quant_type)

    clean = op(x)
    assert torch.isfinite(clean).all()
    assert torch.equal(clean, op(x))
    x[1, 40] = torch.nan
    x[3, 2] = -torch.inf
    out = op(x)
    assert out[[1, 3]].isnan().all()
    assert gguf_linear_ref(x, qweight, quant_type)[[1, 3]].isnan().all()
    assert torch.equal(out[[0, 2, 4]], clean[[0, 2, 4]])


@needs_kernel
@pytest.mark.parametrize("quant_type", QUANT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("num_tokens", [1, 3, 4, 6])
@pytest.mark.parametrize(("out_features", "in_features"), [(8, 32), (40, 544), (576, 1536)])
def test_packed_kernel_gives_the_same_bits_on_both_paths(
        quant_type: GGMLQuantizationType, num_tokens: int, out_features: int,
        in_features: int) -> None:
    """On the packed rows, VNNI's integer sums are AVX2's and its float arithmetic is
    the same, in the same order: the outputs are equal bit for bit."""
    qweight = _weight(quant_type, out_features, in_features)
    x = _x(num_tokens, in_features, torch.float32, seed=num_tokens)
    vnni = _op("packed vnni", qweight, quant_type)(x)
    assert torch.equal(vnni, _op("packed avx2", qweight, quant_type)(x))
    assert float(vnni.abs().max()) > 0


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


@pytest.mark.parametrize("quant_type", QUANT_TYPES, ids=lambda t: t.name)
def test_packing_reorders_the_bytes_and_unpacking_restores_them(
        quant_type: GGMLQuantizationType) -> None:
    """Per group of eight rows and block: the eight d (and m), then 4-byte chunk j of
    each row's quants for each j in turn."""
    qweight = _weight(quant_type, 16, 64)
    packed = pack_rows(qweight, quant_type)
    assert packed.shape == qweight.shape and torch.equal(unpack_rows(packed, quant_type), qweight)
    block = gguf_quants.BLOCK_BYTES[quant_type]
    scales = 4 if quant_type == GGMLQuantizationType.Q4_1 else 2
    group1_block1 = packed[8:16].reshape(-1)[8 * block:16 * block]  # rows 8-15, block 1
    assert torch.equal(group1_block1[2:4], qweight[9, block:block + 2])  # row 9's d
    chunk = group1_block1[8 * scales + 4 * 8 * 2:][4 * 3:4 * 4]  # chunk 2 of row 11
    assert torch.equal(chunk, qweight[11, block + scales + 8:block + scales + 12])
    with pytest.raises(ValueError, match="packing needs a multiple of 8 rows, got 12"):
        pack_rows(qweight[:12], quant_type)


@pytest.mark.parametrize("quant_type", QUANT_TYPES, ids=lambda t: t.name)
def test_without_the_kernel_the_reference_serves_packed_rows(
        monkeypatch: pytest.MonkeyPatch, quant_type: GGMLQuantizationType) -> None:
    qweight = _weight(quant_type, 40, 64)
    packed = pack_rows(qweight, quant_type)
    x = _x(3, 64, torch.float32, seed=4)
    with_kernel = gguf_linear_packed(x, packed, quant_type)
    monkeypatch.setattr(gguf_linear_cpu, "has_cpu_kernel", lambda name: False)
    out = gguf_linear_packed(x, packed, quant_type)
    assert torch.equal(out, gguf_linear_ref(x, qweight, quant_type))
    torch.testing.assert_close(out, with_kernel, rtol=0, atol=1e-5 * float(out.abs().max()))


@needs_kernel
def test_bad_operands_are_refused_by_the_packed_kernel() -> None:
    op = torch.ops.kvmesh.gguf_linear_packed_cpu
    qweight = _weight(GGMLQuantizationType.Q4_1, 12, 64)
    with pytest.raises(RuntimeError, match="packed has 12 rows; it must be a multiple of 8"):
        op(torch.randn(2, 64), qweight, int(GGMLQuantizationType.Q4_1))
    with pytest.raises(RuntimeError, match="gguf_linear_packed_cpu: qweight has 40 bytes per row"):
        op(torch.randn(2, 64), qweight[:8], int(GGMLQuantizationType.Q4_0))
    with pytest.raises(RuntimeError, match=r"quant_type must be 2 \(Q4_0\), 3 \(Q4_1\) or 8"):
        op(torch.randn(2, 64), qweight[:8], 12)


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
