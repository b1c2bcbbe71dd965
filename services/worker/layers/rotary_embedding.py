"""Rotary position embedding (neox / rotate-half layout), plain and Llama-3 scaled."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "llama3")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency remapping: long wavelengths divided by ``factor``,
    short ones kept, the band between interpolated smoothly."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def compute_inv_freq(head_size: int, rope_theta: float,
                     rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    """float32 [head_size // 2] inverse frequencies ``theta^(-2i / head_size)``,
    remapped by ``rope_scaling`` (None or ``rope_type`` in SUPPORTED_ROPE_TYPES)."""
    rope_type = "default" if rope_scaling is None else rope_scaling.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    exponents = torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size
    inv_freq = 1.0 / (rope_theta ** exponents)
    if rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Holds ``cos_sin_cache`` [max_position, head_size]: cos then sin of
    ``position * inv_freq`` (computed in float32, stored in the model dtype).

    ``forward(positions)`` returns ``(cos, sin)``, each [num_tokens, head_size // 2].
    The model gathers them once per step and every layer applies them with
    ``apply_rotary_emb``, rather than each layer indexing the cache again.
    """

    def __init__(self, head_size: int, max_position: int, rope_theta: float,
                 rope_scaling: dict[str, Any] | None, dtype: torch.dtype,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.head_size = head_size
        inv_freq = compute_inv_freq(head_size, rope_theta, rope_scaling).to(device)
        freqs = torch.arange(max_position, dtype=torch.float32, device=device)[:, None] * inv_freq
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos_sin = self.cos_sin_cache.index_select(0, positions)
        cos, sin = cos_sin.chunk(2, dim=-1)
        return cos, sin


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates ``x`` [num_tokens, num_heads, head_size] by (cos, sin) [num_tokens, head_size // 2].

    The two halves of the head are the rotated pairs (rotate-half layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
