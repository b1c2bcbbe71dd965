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

``kvmesh::gguf_linear_packed_cpu`` is the same product on the weight repacked at
load by ``pack_rows``: the same bytes, reordered so that one vector holds a 4-byte
chunk of eight rows' quants and one holds their eight scales. Each row's dot product
then stays on its own vector lane, with no horizontal sums and no scale broadcast
per row: about a third of the instructions per byte on AVX2, where the kernel is
compute-bound at one row (issue 24). With AVX512-VNNI it multiplies two chunks per
512-bit vpdpbusd and gives the AVX2 path's outputs bit for bit.
"""

from __future__ import annotations

import torch

from kernels import gguf_quants
from kernels.cpu_extension import has_cpu_kernel

# Activations below this absmax (per block) quantize to zero, as in the C++ kernel.
_MIN_ABSMAX = 1e-30
# Rows per group of the packed layout.
PACK_ROWS = 8
# Bytes of a block's float16 scales: d, and Q4_1's m.
_SCALE_BYTES = {gguf_quants.GGMLQuantizationType.Q4_0: 2, gguf_quants.GGMLQuantizationType.Q4_1: 4,
                gguf_quants.GGMLQuantizationType.Q8_0: 2}
_CHUNK = 4  # bytes of quants per row in one vector of the packed layout


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


def _split_blocks(rows: torch.Tensor, quant_type: int) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [N, row bytes] as (scales [N, blocks, scale fields, 2], quants
    [N, blocks, chunks, 4]), both views."""
    block_bytes = gguf_quants.BLOCK_BYTES[gguf_quants.GGMLQuantizationType(quant_type)]
    scale_bytes = _SCALE_BYTES[gguf_quants.GGMLQuantizationType(quant_type)]
    blocks = rows.reshape(rows.shape[0], -1, block_bytes)
    scales = blocks[..., :scale_bytes].unflatten(-1, (scale_bytes // 2, 2))
    quants = blocks[..., scale_bytes:].unflatten(-1, (-1, _CHUNK))
    return scales, quants


def pack_rows(qweight: torch.Tensor, quant_type: int) -> torch.Tensor:
    """GGUF rows [N, row bytes] (N a multiple of 8) -> the same bytes in the packed
    layout, same shape: per group of 8 rows and per block, the 8 rows' d (then, for
    Q4_1, their 8 m) as float16, then chunk j (4 bytes) of the quants of row 0..7 for
    each chunk j in turn."""
    num_rows, num_bytes = qweight.shape
    if num_rows % PACK_ROWS:
        raise ValueError(f"packing needs a multiple of {PACK_ROWS} rows, got {num_rows}")
    scales, quants = _split_blocks(qweight, quant_type)
    # [groups, 8, blocks, fields, 2] -> [groups, blocks, fields, 8, 2]
    scales = scales.unflatten(0, (-1, PACK_ROWS)).permute(0, 2, 3, 1, 4)
    quants = quants.unflatten(0, (-1, PACK_ROWS)).permute(0, 2, 3, 1, 4)
    groups, blocks = scales.shape[:2]
    packed = torch.cat([scales.reshape(groups, blocks, -1), quants.reshape(groups, blocks, -1)],
                       dim=-1)
    return packed.reshape(num_rows, num_bytes)


def unpack_rows(packed: torch.Tensor, quant_type: int) -> torch.Tensor:
    """``pack_rows``' inverse: GGUF rows [N, row bytes] from the packed layout."""
    num_rows, num_bytes = packed.shape
    block_bytes = gguf_quants.BLOCK_BYTES[gguf_quants.GGMLQuantizationType(quant_type)]
    scale_bytes = _SCALE_BYTES[gguf_quants.GGMLQuantizationType(quant_type)]
    groups = packed.reshape(num_rows // PACK_ROWS, -1, PACK_ROWS * block_bytes)
    # [groups, blocks, fields, 8, 2] -> [groups, 8, blocks, fields, 2]
    scales = groups[..., :PACK_ROWS * scale_bytes].unflatten(-1, (-1, PACK_ROWS, 2))
    quants = groups[..., PACK_ROWS * scale_bytes:].unflatten(-1, (-1, PACK_ROWS, _CHUNK))
    rows = torch.cat([scales.permute(0, 3, 1, 2, 4).flatten(3),
                      quants.permute(0, 3, 1, 2, 4).flatten(3)], dim=-1)
    return rows.reshape(num_rows, num_bytes)


def gguf_linear_packed(x: torch.Tensor, packed: torch.Tensor, quant_type: int) -> torch.Tensor:
    """``gguf_linear`` on a weight in ``pack_rows``' layout: kvmesh's kernel, else the
    reference on the unpacked rows."""
    if has_cpu_kernel("gguf_linear_packed_cpu"):
        return torch.ops.kvmesh.gguf_linear_packed_cpu(x, packed, int(quant_type))
    return gguf_linear_ref(x, unpack_rows(packed, quant_type), quant_type)
