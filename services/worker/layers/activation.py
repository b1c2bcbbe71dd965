"""SwiGLU's gate: silu(gate) * up on a fused [.., 2 * d] projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """``x = [gate | up]`` of width ``2 * d`` -> ``silu(gate) * up`` of width ``d``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
