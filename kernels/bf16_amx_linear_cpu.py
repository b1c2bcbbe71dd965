"""Linear with a bfloat16 weight on AMX tiles, for batched decode: kvmesh's C++ kernel.

``kvmesh::bf16_amx_linear_cpu`` (kernels/csrc) multiplies bfloat16 x by a weight laid
out once for the tiles (``amx_pack``) with ``tdpbf16ps``: float32 sums of exact
products rounded once to bfloat16, as ``F.linear(x.float(), weight.float())`` up to
summation order. It runs only on CPUs with AMX-BF16 (Sapphire Rapids and later
Xeons), where Linux grants the process the tile state (``has_amx``). On a Xeon with
AMX (2 threads, weights from memory) it took 0.5-0.7x the time of oneDNN's
prepacked linear at 4 to 32 rows, about the same at 64, and 0.8-1.2x at 128 and
256 (benchmarks/RESULTS.md). ``kvmesh::bf16_linear_dispatch`` runs it above a
layer's ``max_rows`` when given its packed weight; the worker's layers do not use
it yet (benchmarks/RESULTS.md says why).
"""

from __future__ import annotations

import torch

from kernels.cpu_extension import has_cpu_kernel

# A block is 32 weight rows by 32 elements of K.
AMX_MULTIPLE = 32


def has_amx() -> bool:
    """Whether the AMX kernel runs here: kvmesh's AVX-512 kernels loaded, the CPU has
    AMX-BF16 and the process may use its tiles."""
    return has_cpu_kernel("bf16_amx_linear_cpu") and torch.ops.kvmesh.bf16_amx_available()


def can_use_amx(weight: torch.Tensor) -> bool:
    """Whether ``amx_pack`` takes ``weight``: a 2-D bfloat16 CPU weight whose both
    dimensions are multiples of ``AMX_MULTIPLE``, on a CPU that ``has_amx``."""
    return (weight.dim() == 2 and weight.dtype is torch.bfloat16 and weight.device.type == "cpu"
            and weight.shape[0] % AMX_MULTIPLE == 0 and weight.shape[1] % AMX_MULTIPLE == 0
            and has_amx())


def amx_pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] as the kernel reads it: [N/16, K/32, 16, 16, 2], a tile per 16
    rows and 32 columns, each of its 16 lines one pair of columns across the 16 rows
    (the pair's two elements side by side). A copy; both dimensions must be multiples
    of ``AMX_MULTIPLE``."""
    n, k = weight.shape
    if n % AMX_MULTIPLE or k % AMX_MULTIPLE:
        raise ValueError(f"amx_pack needs a weight whose dimensions are multiples of "
                         f"{AMX_MULTIPLE}, got {tuple(weight.shape)}")
    tiles = weight.reshape(n // 16, 16, k // 32, 16, 2)  # [n tile, row, k tile, pair, element]
    return tiles.permute(0, 2, 3, 1, 4).contiguous()
