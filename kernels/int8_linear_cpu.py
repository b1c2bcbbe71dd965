"""Weight-only int8 linear for a few rows (decode): kvmesh's C++ kernel, else torch's.

``kvmesh::int8_linear_cpu`` (kernels/csrc, built by `kernels.cpu_extension` on
AVX-512 CPUs) streams each thread's share of the int8 rows with independent
accumulators while it prefetches the next rows; on this project's benchmark machine
it reads a decode step's int8 weights in ~30% less time than
``torch._weight_int8pack_mm``, which computes the same product and serves wherever
the C++ kernel does not.
"""

from __future__ import annotations

import torch

from kernels.cpu_extension import has_cpu_kernel

# The C++ kernel converts int8 in vectors of 16.
_CPU_KERNEL_K_MULTIPLE = 16


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] (float32 or bfloat16, contiguous) @ (``qweight`` int8 [N, K] *
    ``scales`` [N, 1]).T -> [M, N] in ``x``'s dtype; ``scales`` in ``x``'s dtype."""
    if (x.dtype in (torch.float32, torch.bfloat16) and x.shape[1] % _CPU_KERNEL_K_MULTIPLE == 0
            and has_cpu_kernel("int8_linear_cpu")):
        return torch.ops.kvmesh.int8_linear_cpu(x, qweight, scales)
    return torch._weight_int8pack_mm(x, qweight, scales)
