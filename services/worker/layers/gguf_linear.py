"""Linear layers on a GGUF file's own quantized blocks (``quantization="gguf"``, CPU).

The weight stays as the file stores it (Q4_0, Q4_1 or Q8_0 blocks of 32,
``kernels.gguf_quants``). A few rows (decode, a request and its drafts) go to
``kernels.gguf_linear`` (kvmesh's C++ kernel: activations quantized to int8
per block, integer dot products, as llama.cpp does), which reads the blocks
once. Many rows (prefill) are compute-bound: there the weight is dequantized
a chunk of output channels at a time and multiplied by torch's GEMM, the
activations unquantized. Where one ends and the other begins
(``QuantizedLinear.kernel_max_rows``) the worker measures per machine and
model (``services/worker/layers/quantized_choice.py``).

Where this machine's measurement says so (``gguf_layout``), the blocks are kept
repacked by eight rows (``kernels.gguf_linear_cpu.pack_rows``: the same bytes,
reordered for the packed kernel); dequantizing unpacks the rows it needs first.
"""

from __future__ import annotations

import torch

from kernels import gguf_quants
from kernels.gguf_linear_cpu import (PACK_ROWS, gguf_linear, gguf_linear_packed, pack_rows,
                                     unpack_rows)
from services.worker.layers.gguf_layout import serves_packed
from services.worker.layers.quantization import QuantizedLinear, linear_by_channel_chunks


@torch.library.custom_op("kvmesh::gguf_dequantize", mutates_args=())
def gguf_dequantize(qweight: torch.Tensor, quant_type: int, in_features: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """``qweight``'s rows as a float matrix [rows, ``in_features``] of ``dtype``
    (an op, so that compiled graphs call it rather than trace its byte views)."""
    return gguf_quants.dequantize(qweight, quant_type, in_features).to(dtype)


@gguf_dequantize.register_fake
def _gguf_dequantize_fake(qweight: torch.Tensor, quant_type: int, in_features: int,
                          dtype: torch.dtype) -> torch.Tensor:
    return qweight.new_empty(qweight.shape[0], in_features, dtype=dtype)


class GGUFLinear(QuantizedLinear):
    """``y = x @ W.T + bias`` with W [out, in] kept as GGUF blocks.

    ``qweight``: uint8 [out_features, in_features / 32 * block bytes] of
    ``quant_type``; ``x``: [..., in_features], float32 or bfloat16; the output
    has ``x``'s dtype. Holds buffers, no parameters: ``qweight`` in the file's
    layout, or in ``pack_rows``' where ``packed`` (by default where this machine's
    ``gguf_layout`` says; ``packed=True`` says the ``qweight`` given is packed already).
    """

    def __init__(self, qweight: torch.Tensor, quant_type: int, in_features: int,
                 bias: torch.Tensor | None = None, *, packed: bool | None = None) -> None:
        super().__init__()
        expected = gguf_quants.row_bytes(quant_type, in_features)
        if qweight.dtype != torch.uint8 or qweight.dim() != 2 or qweight.shape[1] != expected:
            raise ValueError(f"qweight must be uint8 [out_features, {expected}] for "
                             f"{gguf_quants.GGMLQuantizationType(quant_type).name} with "
                             f"in_features={in_features}, got {qweight.dtype} "
                             f"{tuple(qweight.shape)}")
        self.quant_type = int(gguf_quants.GGMLQuantizationType(quant_type))
        self.in_features, self.out_features = in_features, qweight.shape[0]
        if packed is None:  # the file's rows, to be packed where this machine says
            self.packed = serves_packed(self.quant_type, self.out_features)
            if self.packed:
                qweight = pack_rows(qweight, self.quant_type)
        else:
            self.packed = packed
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach())

    def kernel_linear(self, rows: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return gguf_linear_packed(rows, self.qweight, self.quant_type)
        return gguf_linear(rows, self.qweight, self.quant_type)

    def file_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the weight in the file's layout (a view where not packed)."""
        if not self.packed:
            return self.qweight[start:stop]
        first = start - start % PACK_ROWS  # whole groups of eight, unpacked
        last = min(self.out_features, -(-stop // PACK_ROWS) * PACK_ROWS)
        return unpack_rows(self.qweight[first:last], self.quant_type)[start - first:stop - first]

    def dequantized_linear(self, rows: torch.Tensor) -> torch.Tensor:
        return linear_by_channel_chunks(
            rows, self.out_features,
            lambda start, stop: gguf_dequantize(self.file_rows(start, stop), self.quant_type,
                                                self.in_features, rows.dtype))

    @property
    def weight_format(self) -> str:
        name = gguf_quants.GGMLQuantizationType(self.quant_type).name
        return f"{name} packed" if self.packed else name

    def narrow(self, out_features: int) -> GGUFLinear:
        """Shares this layer's storage where it is in the file's layout or
        ``out_features`` keeps whole groups of eight; else a copy."""
        if self.packed and out_features % PACK_ROWS == 0:
            return GGUFLinear(self.qweight[:out_features], self.quant_type, self.in_features,
                              packed=True)
        return GGUFLinear(self.file_rows(0, out_features), self.quant_type, self.in_features)
