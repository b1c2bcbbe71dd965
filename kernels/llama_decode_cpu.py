"""A Llama-family decode step (one new token per request) in one call, CPU.

``kvmesh::llama_decode_cpu`` (kernels/csrc) runs every decoder layer and the final
norm of a decode-only step: the model's compiled decode step without its ~12 op
launches per layer, which took about a fifth of a one-stream step from Python.
``llama_decode_ref`` is its contract in PyTorch: the same operands, the same
results up to summation order (each product and norm is a float32 sum; bfloat16
may then round to the neighbouring value).

Operands, for ``rows`` requests of one new token each:
- ``hidden`` bfloat16 or float32 [rows, hidden]: the tokens' embeddings; its dtype
  is the activations', and the caches', norms' and ``cos_sin_cache``'s;
- ``positions`` int64 [rows]; ``cos_sin_cache`` [max_position, head_size],
  cos then sin of each position's angles (``RotaryEmbedding.cos_sin_cache``);
- ``weights``: per layer, in order, the input norm's [hidden], qkv_proj's
  [(heads + 2 kv_heads) * head_size, hidden], o_proj's, the post-attention norm's,
  gate_up_proj's [2 intermediate, hidden] and down_proj's; ``final_norm`` [hidden].
  A linear layer is one tensor for ``linear`` "bf16" (its bfloat16 weight), three
  for "w8a8" (int8 weight, float32 scales and int32 weight sums, as
  `kernels.int8_dynamic_linear_cpu` takes them: activations quantized per token) and
  two for "gguf" (its uint8 GGUF blocks as `kernels.gguf_linear_cpu` takes them, in
  the file's rows or packed by eight, and ``gguf_format``'s tensor saying which);
- ``kv_caches``: per layer, [2, num_blocks, block_size, kv_heads, head_size]; each
  token's K and V are written at its ``slot_mapping`` (int64 [rows]) entry before
  attention reads the cache through ``block_table``/``seq_lens`` (int32, the CPU
  attention plan's decode ones).
Returns the final norm's output, [rows, hidden] in ``hidden``'s dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.gguf_linear_cpu import gguf_linear_ref, unpack_rows
from kernels.int8_dynamic_linear_cpu import int8_dynamic_linear_ref
from kernels.paged_attention_cpu import decode_attention

# Tensors per linear layer, by ``linear``.
TENSORS_PER_LINEAR = {"bf16": 1, "w8a8": 3, "gguf": 2}


def weights_per_layer(linear: str) -> int:
    """Tensors per decoder layer in ``weights``: two norms and four linear layers."""
    return 2 + 4 * TENSORS_PER_LINEAR[linear]


def gguf_format(quant_type: int, packed: bool) -> torch.Tensor:
    """A "gguf" linear layer's second tensor: int64 [2], its blocks' GGML quant type
    (Q4_0, Q4_1 or Q8_0) and 1 where its rows are packed by eight (``pack_rows``)."""
    return torch.tensor([int(quant_type), int(packed)], dtype=torch.int64)


def llama_decode_cpu(hidden: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                     weights: list[torch.Tensor], final_norm: torch.Tensor,
                     kv_caches: list[torch.Tensor], slot_mapping: torch.Tensor,
                     block_table: torch.Tensor, seq_lens: torch.Tensor, num_heads: int,
                     num_kv_heads: int, eps: float, scale: float, linear: str = "bf16") -> torch.Tensor:
    """The C++ op (needs ``has_cpu_kernel("llama_decode_cpu")``); see the module."""
    return torch.ops.kvmesh.llama_decode_cpu(hidden, positions, cos_sin_cache, weights, final_norm,
                                             kv_caches, slot_mapping, block_table, seq_lens,
                                             num_heads, num_kv_heads, eps, scale, linear)


def _add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.float() + b.float()).to(a.dtype)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight.float() * normed.float()).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos.float()[:, None], sin.float()[:, None]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def _linear(x: torch.Tensor, tensors: list[torch.Tensor], linear: str) -> torch.Tensor:
    if linear == "bf16":
        return F.linear(x.float(), tensors[0].float()).to(x.dtype)
    if linear == "w8a8":
        qweight, scales, _ = tensors
        return int8_dynamic_linear_ref(x, qweight, scales)
    blocks, (quant_type, packed) = tensors[0], tensors[1].tolist()
    return gguf_linear_ref(x, unpack_rows(blocks, quant_type) if packed else blocks, quant_type)


def llama_decode_ref(hidden: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                     weights: list[torch.Tensor], final_norm: torch.Tensor,
                     kv_caches: list[torch.Tensor], slot_mapping: torch.Tensor,
                     block_table: torch.Tensor, seq_lens: torch.Tensor, num_heads: int,
                     num_kv_heads: int, eps: float, scale: float, linear: str = "bf16") -> torch.Tensor:
    """``llama_decode_cpu`` in PyTorch: every tensor the model keeps between ops
    (the residual, the norm before and after its weight, the rotated q and k,
    silu(gate) * up, each product) in ``hidden``'s dtype (rounded, for bfloat16), the
    arithmetic float32."""
    rows = hidden.shape[0]
    head_size = cos_sin_cache.shape[1]
    q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    n, per_layer = TENSORS_PER_LINEAR[linear], weights_per_layer(linear)
    h, residual = hidden, None
    for layer, kv_cache in enumerate(kv_caches):
        w = weights[per_layer * layer:per_layer * (layer + 1)]
        input_norm, qkv_proj, o_proj = w[0], w[1:1 + n], w[1 + n:1 + 2 * n]
        post_norm, gate_up_proj, down_proj = w[1 + 2 * n], w[2 + 2 * n:2 + 3 * n], w[2 + 3 * n:]
        residual = h if residual is None else _add(h, residual)
        q, k, v = _linear(_rms_norm(residual, input_norm, eps), qkv_proj, linear).split(
            [q_size, kv_size, kv_size], dim=-1)
        q = _rotate(q.reshape(rows, num_heads, head_size), cos, sin)
        k = _rotate(k.reshape(rows, num_kv_heads, head_size), cos, sin)
        cache = kv_cache.view(2, -1, num_kv_heads, head_size)
        cache[0, slot_mapping] = k
        cache[1, slot_mapping] = v.reshape(rows, num_kv_heads, head_size)
        attn = decode_attention(q, kv_cache[0], kv_cache[1], block_table, seq_lens, scale)
        attn_out = _linear(attn.reshape(rows, q_size), o_proj, linear)
        residual = _add(attn_out, residual)
        gate_up = _linear(_rms_norm(residual, post_norm, eps), gate_up_proj, linear)
        gate, up = gate_up.float().chunk(2, dim=-1)
        h = _linear((F.silu(gate) * up).to(hidden.dtype), down_proj, linear)
    return _rms_norm(_add(h, residual), final_norm, eps)
