"""Linear layers on GGUF's Q4_0 / Q4_1 / Q8_0 blocks as the file stores them: kvmesh's
C++ kernel, else a PyTorch reference that computes the same product.

Both quantize each activation row to int8 per block of 32 (as llama.cpp's Q8_0 /
Q8_1: d_x = absmax / 127, q_x = round(x / d_x) half to even; a block with a NaN or an
infinity makes its row's outputs NaN) and multiply it into the weights exactly; they
differ only in float32 summation order. ``kvmesh::gguf_linear_cpu`` (kernels/csrc,
built by `kernels.cpu_extension` for AVX2 and AVX-512 CPUs) never dequantizes the
weights: integer dot products per block (AVX512-VNNI where the CPU has it, else
AVX2), so a decode step reads the file's 4.5 to 8.5 bits per weight once. The
reference dequantizes the whole weight on every call: it is there to be correct,
not fast.
"""

from __future__ import annotations

import torch

from kernels import gguf_quants
from kernels.cpu_extension import has_cpu_kernel

# Activations below this absmax (per block) quantize to zero, as in the C++ kernel.
_MIN_ABSMAX = 1e-30


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] -> float32 [M, K]: each block of 32 as its int8 quantization times
    d_x, the values the kernel multiplies (NaN for a block with a NaN or infinity)."""
    blocks = x.float().reshape(x.shape[0], -1, gguf_quants.BLOCK_SIZE)
    absmax = blocks.abs().amax(dim=-1, keepdim=True)
    tiny = absmax < _MIN_ABSMAX
    # A tensor division: ``127.0 / absmax`` is reciprocal-then-multiply, off by an ulp
    # at times, which flips ties (bfloat16 activations hit exact halves).
    inv_d = torch.where(tiny, 0.0, torch.full_like(absmax, 127.0) / absmax)
    # inf * 0 is NaN, so an infinity spoils its block as a NaN does.
    q = torch.where(absmax.isinf(), torch.nan, torch.round(blocks * inv_d))
    return (q * torch.where(tiny, 0.0, absmax / 127.0)).reshape(x.shape)


def gguf_linear_ref(x: torch.Tensor, qweight: torch.Tensor, quant_type: int) -> torch.Tensor:
    """The kernel's product in PyTorch: quantized activations @ dequantized weights."""
    weight = gguf_quants.dequantize(qweight, quant_type, x.shape[1])
    return (quantize_activations(x) @ weight.T).to(x.dtype)


def gguf_linear(x: torch.Tensor, qweight: torch.Tensor, quant_type: int) -> torch.Tensor:
    """``x`` [M, K] (float32 or bfloat16, contiguous; K a multiple of 32) @ W.T -> [M, N]
    in ``x``'s dtype, W [N, K] given as ``qweight`` uint8 [N, K / 32 * block_bytes] in
    GGUF's blocks of ``quant_type`` (a `gguf_quants.GGMLQuantizationType`)."""
    if has_cpu_kernel("gguf_linear_cpu"):
        return torch.ops.kvmesh.gguf_linear_cpu(x, qweight, int(quant_type))
    return gguf_linear_ref(x, qweight, quant_type)
