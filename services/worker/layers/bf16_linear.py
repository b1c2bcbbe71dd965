"""Linear layers with a bfloat16 weight on the CPU: kvmesh's kernel up to a row count, AMX or oneDNN above.

kvmesh's C++ kernel (``kernels/bf16_linear_cpu.py``) streams the model's plain
[N, K] weight and, on CPUs without AVX512-BF16, beat oneDNN's prepacked bfloat16
linear at every row count the worker measured; where oneDNN has AMX or
AVX512-BF16 it may win the larger products. So each layer holds the plain weight
and ``max_rows``, the largest row count up to which the worker measured our
kernel faster for its shape (``services/worker/layers/linear_choice.py``), and
calls one C++ op, ``kvmesh::bf16_linear_dispatch``, that picks per call: the
choice is a comparison inside that op, so a compiled graph calls the same op
for every batch size, with no branch, guard or Python around it.

Above ``max_rows`` another kernel takes over (``above``, measured too): on CPUs
with AMX, kvmesh's AMX kernel (``kernels/bf16_amx_linear_cpu.py``) or oneDNN,
whichever the worker measured faster for the shape, each on a second copy of the
weight laid out for it; elsewhere oneDNN, on a reordered copy where it runs
bfloat16 natively, else on the plain weight (``F.linear``, which reorders it on
every call). Where our kernel serves every row count (``UNBOUNDED_ROWS``) no copy
is needed, and none is made. The copy is worth its memory where the other kernel
takes over early, on CPUs with AMX or AVX512-BF16: on a Xeon with AMX (2 threads)
oneDNN on the plain weight took 1.5-1.8x the prepacked one's time at 8 to 64 rows
and 1.1-1.4x at 256, while our one-row kernel won only up to 2 or 4 rows. (On a
Xeon without AVX512-BF16 our kernel won every row count.) A shape oneDNN wins
from one row (``max_rows`` 0) stays a ``PackedLinear``.
"""

from __future__ import annotations

import dataclasses
import sys

import torch
from torch import nn

from kernels.bf16_amx_linear_cpu import AMX_MULTIPLE, amx_pack, can_use_amx
from kernels.bf16_linear_cpu import CPU_KERNEL_K_MULTIPLE
from kernels.cpu_extension import has_cpu_kernel

# max_rows for a shape whose every product our kernel serves.
UNBOUNDED_ROWS = sys.maxsize
# What serves a Bf16Linear's rows above max_rows: oneDNN on the plain weight, oneDNN
# on a copy reordered for it, or kvmesh's AMX kernel on a copy laid out for its tiles.
ONEDNN_PLAIN, ONEDNN, AMX = "oneDNN plain", "oneDNN prepacked", "kvmesh AMX"


@dataclasses.dataclass(frozen=True, slots=True)
class Bf16Choice:
    """A shape's ``Bf16Linear``, as measured (``linear_choice``): kvmesh's kernel up
    to ``max_rows`` rows, ``above`` beyond."""

    max_rows: int
    above: str


def can_use_bf16_kernel(weight: torch.Tensor) -> bool:
    """Whether ``Bf16Linear`` serves ``weight``: a 2-D bfloat16 CPU weight whose
    in_features the kernel steps through, with kvmesh's CPU kernels loaded."""
    return (weight.dim() == 2 and weight.dtype is torch.bfloat16 and weight.device.type == "cpu"
            and weight.shape[1] % CPU_KERNEL_K_MULTIPLE == 0
            and has_cpu_kernel("bf16_linear_dispatch"))


class Bf16Linear(nn.Module):
    """``y = x @ weight.T + bias`` for bfloat16: kvmesh's kernel for up to
    ``max_rows`` rows of ``x``, ``above`` for more (``ONEDNN_PLAIN``, ``ONEDNN`` or
    ``AMX``; the last two on a copy of the weight, ``packed_weight``).

    ``x`` is [..., in_features] bfloat16; so is the output. The weight is kept as
    given (a view, not a copy, when it is contiguous: a tied LM head shares the
    embedding's table). The kernels sum in float32 and round once; they differ in
    summation order only. ``max_rows`` 0 sends every row to ``above`` (a shape
    where that is oneDNN is a ``PackedLinear``). ``ONEDNN`` needs oneDNN's native bfloat16
    (``packed_linear.can_pack``), ``AMX`` a CPU and shape that
    ``bf16_amx_linear_cpu.can_use_amx`` takes.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int,
                 above: str = ONEDNN_PLAIN) -> None:
        super().__init__()
        if not can_use_bf16_kernel(weight):
            raise ValueError(f"Bf16Linear needs a 2-D bfloat16 CPU weight with in_features a "
                             f"multiple of {CPU_KERNEL_K_MULTIPLE} and kvmesh's CPU kernels, got "
                             f"{weight.dtype} {tuple(weight.shape)} on {weight.device}")
        if max_rows < 0:
            raise ValueError(f"max_rows must be >= 0, got {max_rows}")
        if above == ONEDNN and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            raise ValueError(f"{ONEDNN} needs oneDNN's native bfloat16, which this CPU lacks")
        if above == AMX and not can_use_amx(weight):
            raise ValueError(f"{AMX} needs a CPU with AMX-BF16 and a weight whose dimensions "
                             f"are multiples of {AMX_MULTIPLE}, got {tuple(weight.shape)}")
        if above not in (ONEDNN_PLAIN, ONEDNN, AMX):
            raise ValueError(f"above must be one of {ONEDNN_PLAIN!r}, {ONEDNN!r}, {AMX!r}, "
                             f"got {above!r}")
        self.out_features, self.in_features = weight.shape
        self.max_rows, self.above = max_rows, above
        self.register_buffer("weight", weight.detach().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().to(weight.dtype))
        packers = {ONEDNN: torch.ops.mkldnn._reorder_linear_weight, AMX: amx_pack}
        self.register_buffer("packed_weight", packers[above](self.weight)
                             if above in packers else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.kvmesh.bf16_linear_dispatch(rows, self.weight, self.bias, self.max_rows,
                                                    self.packed_weight)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        rows = ("at any number of rows" if self.max_rows == UNBOUNDED_ROWS
                else f"up to {self.max_rows} rows, {self.above} above")
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"kvmesh kernel {rows}")
