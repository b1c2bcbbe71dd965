"""Linear layers with a bfloat16 weight on the CPU: kvmesh's kernel up to a row count, oneDNN above.

kvmesh's C++ kernel (``kernels/bf16_linear_cpu.py``) streams the model's plain
[N, K] weight and, on CPUs without AVX512-BF16, beat oneDNN's prepacked bfloat16
linear at every row count the worker measured; where oneDNN has AMX or
AVX512-BF16 it may win the larger products. So each layer holds the plain weight
and ``max_rows``, the largest row count up to which the worker measured our
kernel faster for its shape (``services/worker/layers/linear_choice.py``), and
calls one C++ op, ``kvmesh::bf16_linear_dispatch``, that picks per call: the
choice is a comparison inside that op, so a compiled graph calls the same op
for every batch size, with no branch, guard or Python around it.

Above ``max_rows`` oneDNN multiplies the same plain weight (``F.linear``): one
copy of the weight, not two. A prepacked copy is worth little where oneDNN would
take over, at many rows: on the benchmark machine oneDNN on the plain weight was
within 5% of prepacked from 64 to 2,048 rows (its per-call reorder is small
against the product), though up to 30% slower at 4 to 16 rows of the taller
weights. So a shape oneDNN wins from one row (``max_rows`` 0) stays a
``PackedLinear``.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from kernels.bf16_linear_cpu import CPU_KERNEL_K_MULTIPLE
from kernels.cpu_extension import has_cpu_kernel

# max_rows for a shape whose every product our kernel serves.
UNBOUNDED_ROWS = sys.maxsize


def can_use_bf16_kernel(weight: torch.Tensor) -> bool:
    """Whether ``Bf16Linear`` serves ``weight``: a 2-D bfloat16 CPU weight whose
    in_features the kernel steps through, with kvmesh's CPU kernels loaded."""
    return (weight.dim() == 2 and weight.dtype is torch.bfloat16 and weight.device.type == "cpu"
            and weight.shape[1] % CPU_KERNEL_K_MULTIPLE == 0
            and has_cpu_kernel("bf16_linear_dispatch"))


class Bf16Linear(nn.Module):
    """``y = x @ weight.T + bias`` for bfloat16: kvmesh's kernel for up to
    ``max_rows`` rows of ``x``, oneDNN (``F.linear``) for more.

    ``x`` is [..., in_features] bfloat16; so is the output. The weight is kept as
    given (a view, not a copy, when it is contiguous: a tied LM head shares the
    embedding's table). Both kernels sum in float32 and round once; they differ
    in summation order only. ``max_rows`` must be at least 1 (0 rows of our kernel
    is a ``PackedLinear``).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int) -> None:
        super().__init__()
        if not can_use_bf16_kernel(weight):
            raise ValueError(f"Bf16Linear needs a 2-D bfloat16 CPU weight with in_features a "
                             f"multiple of {CPU_KERNEL_K_MULTIPLE} and kvmesh's CPU kernels, got "
                             f"{weight.dtype} {tuple(weight.shape)} on {weight.device}")
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.out_features, self.in_features = weight.shape
        self.max_rows = max_rows
        self.register_buffer("weight", weight.detach().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().to(weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.kvmesh.bf16_linear_dispatch(rows, self.weight, self.bias, self.max_rows)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        rows = ("at any number of rows" if self.max_rows == UNBOUNDED_ROWS
                else f"up to {self.max_rows} rows, oneDNN above")
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"kvmesh kernel {rows}")
