"""Repetition, frequency and presence penalties, batched over the rows."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def make_padded_token_ids(
    token_id_lists: Sequence[Sequence[int]],
    pad_id: int,
    device: torch.device,
    pin_memory: bool = False,
) -> torch.Tensor:
    """int64 ``[len(lists), max_len]``; short rows are padded with ``pad_id``.

    Padding with ``vocab_size`` lets the bin counts drop it as an extra column.
    """
    max_len = max((len(ids) for ids in token_id_lists), default=0)
    padded = np.full((len(token_id_lists), max_len), pad_id, dtype=np.int64)
    for row, ids in enumerate(token_id_lists):
        if ids:
            padded[row, : len(ids)] = ids
    tensor = torch.from_numpy(padded)
    if device.type == "cpu":
        return tensor
    if pin_memory:
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def token_bin_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 ``[n, vocab]``: how often each token occurs in each row (ids == vocab are padding)."""
    counts = torch.zeros(
        (token_ids.shape[0], vocab_size + 1), dtype=torch.int32, device=token_ids.device
    )
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.int32))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor,
    output_token_ids: torch.Tensor,
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    repetition_penalties: torch.Tensor,
) -> torch.Tensor:
    """Return float32 ``logits [n, vocab]`` penalised as vLLM and HF do.

    - repetition (tokens seen in prompt or output): positive logits are divided
      by the penalty, negative ones multiplied (1.0 = off);
    - frequency: minus ``penalty * count in output``;
    - presence: minus ``penalty`` if the token occurs in the output.
    Token id tensors are int64 ``[n, L]`` padded with ``vocab``; penalties are ``[n]``.
    """
    vocab_size = logits.shape[1]
    output_counts = token_bin_counts(output_token_ids, vocab_size)
    output_mask = output_counts > 0
    seen = token_bin_counts(prompt_token_ids, vocab_size) > 0
    seen |= output_mask
    repetition = torch.where(seen, repetition_penalties.unsqueeze(1), 1.0)
    # Divide (not multiply by the reciprocal) so results match HF bit for bit.
    logits = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits -= frequency_penalties.unsqueeze(1) * output_counts
    logits -= presence_penalties.unsqueeze(1) * output_mask
    return logits
