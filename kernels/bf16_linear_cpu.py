"""Linear with a bfloat16 weight for a few rows (decode): kvmesh's C++ kernel, else torch's.

``kvmesh::bf16_linear_cpu`` (kernels/csrc, built by `kernels.cpu_extension` for
AVX-512 and AVX2 CPUs) streams each thread's share of the weight rows with
independent float32 accumulators while it prefetches the next rows, and loads each
weight vector once per block of up to four activation rows. It reads the model's
plain [N, K] weight: no packing. Bfloat16 activations are multiplied in pairs by
AVX512-BF16's ``vdpbf16ps`` where the CPU has it; otherwise the weights are widened
to float32 (exact) and multiplied with FMAs. ``F.linear`` computes the same product
(float32 sums of exact products, rounded once to ``x``'s dtype) and serves wherever
the C++ kernel does not; the results differ only in summation order.

On this project's benchmark machine (a Xeon with AVX-512 but not AVX512-BF16), with
the model's weights read from memory, it took 0.55-0.8x the time of oneDNN's
prepacked linear at one row and a third of it or less at 2 to 16 rows. The worker's
bfloat16 layers call it up to the row count measured in its favour on their machine,
through ``kvmesh::bf16_linear_dispatch`` (services/worker/layers/bf16_linear.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu_extension import has_cpu_kernel

# The C++ kernel steps through K 32 elements at a time.
CPU_KERNEL_K_MULTIPLE = 32


def bf16_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] (float32 or bfloat16) @ ``weight`` (bfloat16 [N, K], contiguous).T
    -> [M, N] in ``x``'s dtype, summed in float32."""
    if (x.dtype in (torch.float32, torch.bfloat16) and x.shape[1] % CPU_KERNEL_K_MULTIPLE == 0
            and has_cpu_kernel("bf16_linear_cpu")):
        return torch.ops.kvmesh.bf16_linear_cpu(x, weight)
    return F.linear(x, weight.to(x.dtype))
