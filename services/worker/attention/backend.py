"""Attention backends and what each supports inside a CUDA graph."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from kernels._dispatch import use_triton


class AttentionCGSupport(enum.Enum):
    """How much of a batch an attention backend can run inside a full CUDA graph.

    Ordered by capability: a backend supporting a level supports every lower one.
    """

    NEVER = 0
    """No CUDA graphs: host work per call (the PyTorch reference plans on the CPU)."""
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    """Only batches whose every request has exactly one query token."""
    UNIFORM_BATCH = 2
    """Only batches whose requests all have the same query length (1 + speculative tokens)."""
    ALWAYS = 3
    """Any batch, prefill and decode mixed."""


@dataclass(frozen=True, slots=True)
class AttentionBackend:
    name: str
    cudagraph_support: AttentionCGSupport


# One Triton kernel serves every batch shape and needs only device-side metadata,
# with launch parameters taken from host ints that a padded batch fixes.
TRITON_ATTN = AttentionBackend("TRITON_ATTN", AttentionCGSupport.ALWAYS)
# The CPU path builds an index plan on the host from the batch's lengths.
TORCH_REF_ATTN = AttentionBackend("TORCH_REF_ATTN", AttentionCGSupport.NEVER)


def get_attention_backend(device: torch.device) -> AttentionBackend:
    """The backend `Attention` layers use for tensors on ``device``."""
    return TRITON_ATTN if use_triton(torch.empty(0, device=device)) else TORCH_REF_ATTN
