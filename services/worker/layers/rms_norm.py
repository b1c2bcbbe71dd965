"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, the statistics taken in float32.

    ``forward(x)`` returns the normalized tensor. ``forward(x, residual)`` first
    adds ``residual`` to ``x`` and returns ``(normalized, x + residual)``, the sum
    being the next residual stream (vLLM's fused add + norm).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
            residual = x
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One fused op, bitwise equal to the steps below when nothing is cast; it
            # saves ~5 small ops per norm, 61 norms per step of a 30-layer model.
            out = F.rms_norm(x, self.weight.shape, self.weight, self.variance_epsilon)
            return out if residual is None else (out, residual)
        x_fp32 = x.float()
        variance = x_fp32.pow(2).mean(-1, keepdim=True)
        # Cast back before scaling by the weight, as the Llama reference does, so
        # half-precision results round identically.
        out = self.weight * (x_fp32 * torch.rsqrt(variance + self.variance_epsilon)).to(x.dtype)
        return out if residual is None else (out, residual)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}"
