"""A GGUF file's linear weights as the file stores them: quantized blocks, not floats.

``--quantization gguf`` serves the GGUF's own Q4_0 / Q4_1 / Q8_0 blocks
(kernels/gguf_quants.py) instead of the floats the file was dequantized to, so
a decode step reads the file's 4.5 to 8.5 bits a weight. Tensors are named
here as in the Hugging Face checkpoint (gguf's own name map), and the q and
k projections get back the row order llama.cpp's converter permuted for its
rotary embedding (as transformers' GGUF loader does for floats): a row of
blocks moves whole, so the permutation needs no dequantizing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import MODEL_TENSOR, TENSOR_NAMES

from kernels.gguf_quants import GGMLQuantizationType
from services.worker.gguf_file import read_gguf

# Hugging Face name -> GGUF tensor, as gguf.get_tensor_name_map maps llama's
# (building that whole map costs a third of a second a start): the embedding,
# the head, and by suffix the linear layers of a decoder layer.
_TOP_LEVEL = {"model.embed_tokens": MODEL_TENSOR.TOKEN_EMBD, "lm_head": MODEL_TENSOR.OUTPUT}
_LAYER_LINEARS = {
    "self_attn.q_proj": MODEL_TENSOR.ATTN_Q, "self_attn.k_proj": MODEL_TENSOR.ATTN_K,
    "self_attn.v_proj": MODEL_TENSOR.ATTN_V, "self_attn.o_proj": MODEL_TENSOR.ATTN_OUT,
    "mlp.gate_proj": MODEL_TENSOR.FFN_GATE, "mlp.up_proj": MODEL_TENSOR.FFN_UP,
    "mlp.down_proj": MODEL_TENSOR.FFN_DOWN}


@dataclass(frozen=True)
class QuantizedWeight:
    """One weight [out_features, in_features] as GGUF blocks: ``data`` uint8
    [out_features, row bytes] of ``quant_type``."""

    data: torch.Tensor
    quant_type: GGMLQuantizationType
    in_features: int


def _reverse_permute_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row permutation (each head's two rotary halves
    interleaved) on whole rows of any width."""
    half = rows.shape[0] // num_heads // 2
    return rows.reshape(num_heads, half, 2, -1).swapaxes(1, 2).reshape(rows.shape)


def read_quantized_linears(gguf_path: Path, num_layers: int, num_heads: int,
                           num_kv_heads: int) -> dict[str, QuantizedWeight]:
    """Hugging Face name -> QuantizedWeight for every decoder linear weight and
    the embedding (a tied LM head's weight) stored in a served block type;
    weights stored otherwise (F32, F16, K-quants) are left out: they stay float.
    ValueError for a file of another architecture than llama (whose q/k rows
    llama.cpp's converter permutes; others it leaves alone)."""
    gguf_file = read_gguf(gguf_path)
    architecture = gguf_file.metadata.get("general.architecture")
    if architecture != "llama":
        raise ValueError(f"quantization 'gguf' serves llama GGUF files; {gguf_path.name} is "
                         f"{architecture!r}")
    gguf_names = {hf_name: TENSOR_NAMES[tensor] for hf_name, tensor in _TOP_LEVEL.items()}
    gguf_names |= {f"model.layers.{i}.{suffix}": TENSOR_NAMES[tensor].format(bid=i)
                   for i in range(num_layers) for suffix, tensor in _LAYER_LINEARS.items()}
    weights: dict[str, QuantizedWeight] = {}
    for hf_name, gguf_name in gguf_names.items():
        tensor = gguf_file.tensors.get(f"{gguf_name}.weight")
        if tensor is None or int(tensor.tensor_type) not in GGMLQuantizationType._value2member_map_:
            continue
        rows = tensor.data  # uint8 [out_features, row bytes], a view of the mapped file
        if hf_name.endswith("q_proj"):
            rows = _reverse_permute_rows(rows, num_heads)
        elif hf_name.endswith("k_proj"):
            rows = _reverse_permute_rows(rows, num_kv_heads)
        weights[f"{hf_name}.weight"] = QuantizedWeight(
            torch.from_numpy(np.array(rows)),  # a copy: the mapping is read-only and closes
            GGMLQuantizationType(int(tensor.tensor_type)), tensor.shape[-1])
    return weights


def fuse_quantized(parts: list[QuantizedWeight | None]) -> QuantizedWeight | None:
    """The parts of a fused layer (q, k, v; gate, up) stacked by rows, as the
    layer's float weight is; None unless every part is there in one block type
    and width."""
    if not parts or any(p is None for p in parts):
        return None
    first = parts[0]
    if any(p.quant_type != first.quant_type or p.in_features != first.in_features
           for p in parts):
        return None
    data = first.data if len(parts) == 1 else torch.cat([p.data for p in parts])
    return QuantizedWeight(data, first.quant_type, first.in_features)
