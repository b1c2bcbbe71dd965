"""Choice between a Triton kernel and its PyTorch reference."""

from __future__ import annotations

import os

import torch


def use_triton(tensor: torch.Tensor) -> bool:
    """True when the Triton kernel should run for an op on `tensor`.

    Triton runs on CUDA tensors; CPU tensors take the PyTorch reference unless
    `KVMESH_FORCE_TRITON=1` (tests run the kernels through `TRITON_INTERPRET=1`).
    The variable is read per call so that nothing is frozen at import time.
    """
    return tensor.is_cuda or os.environ.get("KVMESH_FORCE_TRITON", "0") == "1"
