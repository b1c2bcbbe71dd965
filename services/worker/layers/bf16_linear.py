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

Above ``max_rows`` oneDNN takes over, on a second copy of the weight reordered
for it (``packed``) where oneDNN runs bfloat16 natively, else on the plain weight
(``F.linear``, which reorders it on every call). Where our kernel serves every row
count (``UNBOUNDED_ROWS``) no copy is needed, and none is made. The copy is worth
its memory where oneDNN takes over early, on CPUs with AMX or AVX512-BF16: on a
Xeon with AMX (2 threads) the plain weight took 1.5-1.8x the prepacked one's time
at 8 to 64 rows and 1.1-1.4x at 256, while our kernel won only up to 2 or 4 rows.
(On a Xeon without AVX512-BF16 our kernel won every row count.) A shape oneDNN
wins from one row (``max_rows`` 0) stays a ``PackedLinear``.
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
    ``max_rows`` rows of ``x``, oneDNN for more (on ``packed_weight`` where
    ``packed``, else ``F.linear`` on the plain weight).

    ``x`` is [..., in_features] bfloat16; so is the output. The weight is kept as
    given (a view, not a copy, when it is contiguous: a tied LM head shares the
    embedding's table). Both kernels sum in float32 and round once; they differ
    in summation order only. ``max_rows`` must be at least 1 (0 rows of our kernel
    is a ``PackedLinear``); ``packed`` needs oneDNN's native bfloat16
    (``packed_linear.can_pack``).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int,
                 packed: bool = False) -> None:
        super().__init__()
        if not can_use_bf16_kernel(weight):
            raise ValueError(f"Bf16Linear needs a 2-D bfloat16 CPU weight with in_features a "
                             f"multiple of {CPU_KERNEL_K_MULTIPLE} and kvmesh's CPU kernels, got "
                             f"{weight.dtype} {tuple(weight.shape)} on {weight.device}")
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        if packed and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            raise ValueError("packed needs oneDNN's native bfloat16, which this CPU lacks")
        self.out_features, self.in_features = weight.shape
        self.max_rows = max_rows
        self.register_buffer("weight", weight.detach().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().to(weight.dtype))
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(self.weight)
                             if packed else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.kvmesh.bf16_linear_dispatch(rows, self.weight, self.bias, self.max_rows,
                                                    self.packed_weight)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        above = "oneDNN prepacked" if self.packed_weight is not None else "oneDNN"
        rows = ("at any number of rows" if self.max_rows == UNBOUNDED_ROWS
                else f"up to {self.max_rows} rows, {above} above")
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"kvmesh kernel {rows}")
