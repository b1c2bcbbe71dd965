"""Linear layers whose weights are reordered once for oneDNN (the CPU worker).

``F.linear`` on the CPU hands oneDNN (bfloat16) or MKL (float32) a plain
row-major weight, which oneDNN reorders into its blocked layout on every call
and MKL runs without AVX-512 on some CPUs. Reordered once at start-up, as
inductor's weight prepacking does under freezing, the same products ran 1.2-4x
faster on the benchmark machine (decode GEMVs most, float32 everywhere). The
result is bit-identical in bfloat16 and differs in float32 only by summation order.

Layers call the kernel through the custom op ``kvmesh::onednn_linear``, which
inductor lowers to a direct call of oneDNN's kernel: inductor's own lowering of
that kernel insists that the weight be a constant frozen into the graph, which
would keep the compiled artefacts out of the on-disk cache.

Bfloat16 layers go to kvmesh's own kernel instead wherever the worker measured it
faster (``cpu_linear``, ``services/worker/layers/bf16_linear.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch
from torch import nn

from services.worker.layers.bf16_linear import UNBOUNDED_ROWS, Bf16Linear

# The dtypes oneDNN's prepacked linear serves; float16 layers keep nn.Linear.
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


@torch.library.custom_op("kvmesh::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, packed_weight: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` [M, in] @ weight.T + bias, where ``packed_weight`` is the weight as
    ``torch.ops.mkldnn._reorder_linear_weight`` laid it out (a ``PackedLinear``'s)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


@onednn_linear.register_fake
def _onednn_linear_fake(x: torch.Tensor, packed_weight: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed_weight.shape[0])


@functools.cache  # once per process; on first use, as importing inductor takes ~1.5 s
def _register_inductor_lowering() -> None:
    """Compiled graphs call oneDNN's kernel itself, as an extern kernel, rather than
    the custom op's Python body (5 us a call, 121 calls a decode step)."""
    from torch._inductor.lowering import fallback_handler, register_lowering

    call_onednn = fallback_handler(torch.ops.mkldnn._linear_pointwise.default,
                                   add_to_fallback_set=False)

    @register_lowering(torch.ops.kvmesh.onednn_linear, type_promotion_kind=None)
    def _lower(x, packed_weight, bias):  # noqa: ANN001, ANN202 (inductor's IR nodes)
        return call_onednn(x, packed_weight, bias, "none", [], "")


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``PackedLinear`` serves layers of ``dtype`` on ``device``: the CPU,
    with oneDNN built in, float32 or bfloat16 (where oneDNN runs it natively)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype is torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype in PACKABLE_DTYPES


class PackedLinear(nn.Module):
    """``y = x @ weight.T + bias`` on oneDNN with the weight reordered once.

    ``x`` is [..., in_features] in the weight's dtype; so is the output. Holds
    the reordered weight (an opaque oneDNN tensor: it cannot be read back as a
    matrix or cast) and the bias as buffers; nothing here is trained.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        if weight.dim() != 2 or not can_pack(weight.dtype, weight.device):
            raise ValueError(f"PackedLinear needs a 2-D CPU weight of dtype "
                             f"{' or '.join(map(str, PACKABLE_DTYPES))} (bfloat16 only where "
                             f"oneDNN supports it), got {weight.dtype} {tuple(weight.shape)} "
                             f"on {weight.device}")
        _register_inductor_lowering()  # before any graph that calls this layer compiles
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed_weight",
                             torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous()))
        self.register_buffer("bias", None if bias is None else bias.detach().to(weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.kvmesh.onednn_linear(rows, self.packed_weight, self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN prepacked"


def cpu_linear(weight: torch.Tensor, bias: torch.Tensor | None,
               bf16_max_rows: Mapping[tuple[int, int], int]) -> nn.Module | None:
    """The CPU layer for a weight: a ``Bf16Linear`` where the weight is bfloat16 and
    ``bf16_max_rows`` (shape -> rows, from ``linear_choice.bf16_max_rows_by_shape``)
    gives its shape at least one row of kvmesh's kernel (with a prepacked copy for
    oneDNN's rows where it ``can_pack`` and they are not none), else a
    ``PackedLinear`` where it ``can_pack``, else None (``nn.Linear`` serves it as
    well as anything).

    Where oneDNN has no native bfloat16 (AVX2-only CPUs) a bfloat16 weight is never
    packed, but kvmesh's kernel still serves it up to its measured row count.
    """
    max_rows = bf16_max_rows.get(tuple(weight.shape), 0) if weight.dtype is torch.bfloat16 else 0
    packable = can_pack(weight.dtype, weight.device)
    if max_rows > 0:
        return Bf16Linear(weight, bias, max_rows, packed=packable and max_rows != UNBOUNDED_ROWS)
    return PackedLinear(weight, bias) if packable else None


def pack_linears_(module: nn.Module,
                  bf16_max_rows: Mapping[tuple[int, int], int] | None = None) -> int:
    """Replaces every ``nn.Linear`` inside ``module`` that has a ``cpu_linear`` with it
    (a ``PackedLinear`` wherever it ``can_pack``, without ``bf16_max_rows``);
    returns how many were replaced."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            layer = cpu_linear(child.weight, child.bias, bf16_max_rows or {})
            if layer is not None:
                setattr(module, name, layer)
                count += 1
        else:
            count += pack_linears_(child, bf16_max_rows)
    return count
