"""Host-to-device tensor helpers shared by the built-in logits processors."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device_tensor(
    data: Sequence[int] | Sequence[float],
    dtype: torch.dtype,
    device: torch.device,
    pin_memory: bool,
) -> torch.Tensor:
    """Build on the CPU (pinned when asked) and copy asynchronously to ``device``."""
    cpu = torch.tensor(data, dtype=dtype, device="cpu")
    if device.type == "cpu":
        return cpu
    if pin_memory:
        cpu = cpu.pin_memory()
    return cpu.to(device, non_blocking=True)


def sparse_index(rows: list[int], token_ids: list[int], device: torch.device,
                 pin_memory: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token id) pairs as two int64 tensors, for indexing a logits batch."""
    return (
        to_device_tensor(rows, torch.int64, device, pin_memory),
        to_device_tensor(token_ids, torch.int64, device, pin_memory),
    )
