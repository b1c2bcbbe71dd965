"""Logprobs of sampled and prompt tokens: top-N, the chosen token first, and its rank."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.engine import Logprobs


@dataclass(slots=True)
class LogprobsTensors:
    """Row i: the sampled (or prompt) token first, then the top-N tokens by logprob.

    ``sampled_token_ranks[i]`` is the first token's rank in the whole
    vocabulary (1 = most likely; ties share the better rank).
    """

    logprob_token_ids: torch.Tensor  # int64 [n, N + 1]
    logprobs: torch.Tensor  # float32 [n, N + 1]
    sampled_token_ranks: torch.Tensor  # int64 [n]

    def to_logprobs(self) -> Logprobs:
        """Host lists for every row (one device-to-host copy per tensor)."""
        return Logprobs(
            token_ids=self.logprob_token_ids.tolist(),
            logprobs=self.logprobs.tolist(),
            sampled_token_ranks=self.sampled_token_ranks.tolist(),
        )


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """float32 log-softmax over the vocabulary."""
    return logits.log_softmax(dim=-1, dtype=torch.float32)


def gather_logprobs(
    logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor
) -> LogprobsTensors:
    """Logprob and rank of ``token_ids [n]`` plus the ``num_logprobs`` best tokens per row."""
    token_ids = token_ids.to(torch.int64).unsqueeze(1)
    token_logprobs = logprobs.gather(1, token_ids)
    ranks = (logprobs > token_logprobs).sum(dim=1) + 1
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=1)
    return LogprobsTensors(
        logprob_token_ids=torch.cat((token_ids, top_ids), dim=1),
        logprobs=torch.cat((token_logprobs, top_logprobs), dim=1),
        sampled_token_ranks=ranks,
    )


def resolve_num_logprobs(num_logprobs: int, vocab_size: int) -> int:
    """-1 means the whole vocabulary (vLLM); otherwise 0..vocab_size."""
    if num_logprobs == -1:
        return vocab_size
    if not 0 <= num_logprobs <= vocab_size:
        raise ValueError(f"num_logprobs must be -1 or in [0, {vocab_size}], got {num_logprobs}")
    return num_logprobs


def compute_prompt_logprobs(
    logits: torch.Tensor, target_token_ids: torch.Tensor, num_logprobs: int
) -> Logprobs:
    """Logprobs of each prompt position's next token.

    ``logits[i]`` is the model's output at prompt position i and
    ``target_token_ids[i]`` the prompt token that follows it. Returns one
    Logprobs row per position: the target token first, then the top
    ``num_logprobs`` (-1 = whole vocabulary), plus the target's rank.
    """
    num_logprobs = resolve_num_logprobs(num_logprobs, logits.shape[-1])
    logprobs = compute_logprobs(logits)
    return gather_logprobs(logprobs, num_logprobs, target_token_ids).to_logprobs()
