"""Int8 linear layers on the CPU: weight-only (``quantization="int8"``) or with
activations quantized per token too (``quantization="w8a8"``).

Each output channel (weight row) gets one scale, ``absmax(row) / 127``, and
its weights are rounded to int8 in [-127, 127]. Weight-only, activations stay
in the model's dtype: the int8 GEMV (`kernels.int8_linear_cpu`: kvmesh's C++
kernel, else ``torch._weight_int8pack_mm``) converts inside the product, so a
decode step reads half the bytes of bfloat16 weights. w8a8 quantizes each
activation row to int8 as well, at every call, and multiplies integers
(`kernels.int8_dynamic_linear_cpu`: AVX512-VNNI, else AVX2): 0.5-0.65x the
weight-only time at one row and about half at 16 rows on the benchmark machine,
for a perplexity 3.5-4% above the unquantized model's on the shipped text
(weight-only: 0.5%). With VNNI, from 16 rows on its kernel is a GEMM that beat
oneDNN's bfloat16 linear on a Zen 5, so w8a8 is the fastest way to serve many
streams there.
Up to ``kernel_max_rows`` rows go to the kernel; more (a prefill, a wide
decode) dequantize the weight a chunk at a time and call torch's GEMM,
activations unquantized, in both modes. Which rows the kernel wins is measured
per machine and model (``services/worker/layers/quantized_choice.py``): on the
benchmark machine (Cascade Lake, 2 threads) w8a8's kernel beat
dequantize-then-GEMM at every row count up to 512, weight-only int8's up to
128.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kernels.int8_dynamic_linear_cpu import CPU_KERNEL_K_MULTIPLE, int8_dynamic_linear, weight_sums
from kernels.int8_linear_cpu import int8_linear

INT8_MAX = 127
# The rows a quantized layer's kernel takes until the worker has measured this
# machine (``QuantizedLinear.kernel_max_rows``): beyond them dequantize-then-GEMM.
DEFAULT_KERNEL_MAX_ROWS = 31
# torch's int8 kernel is vectorized over K in blocks; with bfloat16 inputs and K
# not a multiple of its block it returns garbage (torch 2.13), so such layers
# always take the dequantize path.
INT8_KERNEL_K_MULTIPLE = 32
# The largest dequantized weight (bytes) a dequantize-then-GEMM call materializes.
_DEQUANTIZE_CHUNK_BYTES = 8 << 20


def linear_by_channel_chunks(rows: torch.Tensor, out_features: int,
                             dequantize: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """``rows`` @ W.T for a quantized W [out_features, in_features], whose output
    channels [start, stop) ``dequantize(start, stop)`` gives in ``rows``' dtype:
    the GEMM a chunk of channels at a time, at most ``_DEQUANTIZE_CHUNK_BYTES``
    of weight each. A temporary weight above glibc's largest mmap threshold
    (32 MB: the LM head's is 56 MB in bfloat16) is mapped afresh on every call,
    and its page faults took 3x the GEMM's own time."""
    chunk = max(1, _DEQUANTIZE_CHUNK_BYTES // (rows.shape[1] * rows.element_size()))
    outs = [F.linear(rows, dequantize(start, min(start + chunk, out_features)))
            for start in range(0, out_features, chunk)]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def quantize_per_channel_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel quantization of ``weight`` [out, in].

    Returns (int8 [out, in], float32 scales [out]) with
    ``weight ~= int8 * scales[:, None]``; an all-zero row gets scale 1.
    """
    weight = weight.float()
    absmax = weight.abs().amax(dim=1)
    scales = torch.where(absmax > 0, absmax / INT8_MAX, torch.ones_like(absmax))
    qweight = torch.round(weight / scales[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return qweight, scales


class QuantizedLinear(nn.Module, abc.ABC):
    """A linear layer on a quantized weight with two ways to multiply it: its
    kernel (``kernel_linear``, for the rows of a decode) and dequantize-then-GEMM
    (``dequantized_linear``). ``forward`` picks the kernel for up to
    ``kernel_max_rows`` rows where ``has_kernel``. Subclasses set ``in_features``,
    ``out_features`` and a ``bias`` buffer (or None).
    """

    in_features: int
    out_features: int
    kernel_max_rows: int = DEFAULT_KERNEL_MAX_ROWS

    @property
    def has_kernel(self) -> bool:
        """Whether ``kernel_linear`` may be called (the layer's shape fits the kernel)."""
        return True

    @property
    @abc.abstractmethod
    def weight_format(self) -> str:
        """How the weight is stored and multiplied, e.g. ``"w8a8"``, ``"Q4_1"``."""

    @abc.abstractmethod
    def kernel_linear(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` [M, in_features], contiguous, times the weight, without the bias."""

    @abc.abstractmethod
    def dequantized_linear(self, rows: torch.Tensor) -> torch.Tensor:
        """The same product, the weight dequantized to ``rows``' dtype a chunk at a time."""

    @abc.abstractmethod
    def narrow(self, out_features: int) -> QuantizedLinear:
        """A layer over this one's first ``out_features`` output channels (sharing
        its storage, no bias): what ``quantized_choice`` times for a tall head."""

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{self.weight_format}, kernel_max_rows={self.kernel_max_rows}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] <= self.kernel_max_rows and self.has_kernel:
            out = self.kernel_linear(rows.contiguous())
        else:
            out = self.dequantized_linear(rows)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


class Int8Linear(QuantizedLinear):
    """``y = x @ (qweight * scales[:, None]).T + bias`` with an int8 ``qweight``.

    ``x`` is [..., in_features] in ``scales``' dtype; so is the output.
    Built from a float layer's weight by ``from_float``; holds buffers, no
    parameters (nothing here is trained).
    """

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None) -> None:
        super().__init__()
        if qweight.dtype != torch.int8 or qweight.dim() != 2 or scales.shape != qweight.shape[:1]:
            raise ValueError(f"qweight must be int8 [out, in] and scales [out], got "
                             f"{qweight.dtype} {tuple(qweight.shape)} and {tuple(scales.shape)}")
        self.in_features, self.out_features = qweight.shape[1], qweight.shape[0]
        self.use_int8_kernel = self.in_features % INT8_KERNEL_K_MULTIPLE == 0
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scales", scales)
        self.register_buffer("bias", bias)
        self.register_buffer("weight_sums", None)  # set by use_dynamic_activations
        self.register_buffer("float_scales", None)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None,
                   dtype: torch.dtype) -> Int8Linear:
        """Quantizes ``weight`` [out, in]; scales and bias are kept in ``dtype``."""
        qweight, scales = quantize_per_channel_int8(weight)
        return cls(qweight, scales.to(dtype), None if bias is None else bias.to(dtype))

    @property
    def dynamic_activations(self) -> bool:
        """Whether a few rows are quantized to int8 per token (``use_dynamic_activations``)."""
        return self.weight_sums is not None

    def use_dynamic_activations(self) -> bool:
        """From now on a few rows (decode) are quantized per token and multiplied in
        integers (w8a8); whether the layer can (its in_features a multiple of 64)."""
        if self.in_features % CPU_KERNEL_K_MULTIPLE:
            return False
        self.register_buffer("weight_sums", weight_sums(self.qweight))
        self.register_buffer("float_scales", self.scales.float())
        return True

    @property
    def has_kernel(self) -> bool:
        return self.use_int8_kernel

    def kernel_linear(self, rows: torch.Tensor) -> torch.Tensor:
        if self.weight_sums is not None:
            return int8_dynamic_linear(rows, self.qweight, self.float_scales, self.weight_sums)
        return int8_linear(rows, self.qweight, self.scales)

    def dequantized_linear(self, rows: torch.Tensor) -> torch.Tensor:
        return linear_by_channel_chunks(
            rows, self.out_features,
            lambda start, stop: self.qweight[start:stop].to(rows.dtype)
            * self.scales[start:stop, None])

    @property
    def weight_format(self) -> str:
        return "w8a8" if self.dynamic_activations else "int8"

    def narrow(self, out_features: int) -> Int8Linear:
        layer = Int8Linear(self.qweight[:out_features], self.scales[:out_features], None)
        if self.dynamic_activations:
            layer.use_dynamic_activations()
        return layer


def quantize_linears_int8(module: nn.Module, dtype: torch.dtype) -> int:
    """Replaces every ``nn.Linear`` inside ``module`` with an ``Int8Linear``.

    Returns how many layers were replaced; scales and biases are in ``dtype``.
    """
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, Int8Linear.from_float(child.weight, child.bias, dtype))
            count += 1
        else:
            count += quantize_linears_int8(child, dtype)
    return count


def use_dynamic_activations_(module: nn.Module) -> int:
    """Turns every ``Int8Linear`` inside ``module`` (itself included) to w8a8
    (``Int8Linear.use_dynamic_activations``); returns how many could."""
    return sum(layer.use_dynamic_activations() for layer in module.modules()
               if isinstance(layer, Int8Linear))
