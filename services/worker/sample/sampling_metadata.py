"""SamplingMetadata: one step's sampling parameters for rows [0, num_reqs)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.sample.logits_processor import LogitsProcessors

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5


@dataclass(slots=True)
class SamplingMetadata:
    """Device tensors are ``[num_reqs]`` and read-only for the sampler.

    A feature no row uses is None (or flagged off) so the sampler skips it.
    Min-p is not here: it is the MinPLogitsProcessor's own state.
    """

    temperature: torch.Tensor | None  # float32; greedy rows hold 0.0; None when all_greedy
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None  # float32; 1.0 = off
    top_k: torch.Tensor | None  # int64; vocab_size = off
    max_top_k: int  # largest enabled top_k (0 when top_k is None)
    # Seeded random rows: row -> generator, already positioned for this step.
    generators: dict[int, torch.Generator]
    max_num_logprobs: int | None  # None when no row asked for logprobs
    no_penalties: bool
    presence_penalties: torch.Tensor  # float32
    frequency_penalties: torch.Tensor  # float32
    repetition_penalties: torch.Tensor  # float32
    # int64 [num_reqs, max_prompt_len] padded with vocab_size; rows without a
    # repetition penalty are all padding. None when no_penalties.
    prompt_token_ids: torch.Tensor | None
    # Live output lists of the rows with a penalty ([] for the others); empty when no_penalties.
    output_token_ids: list[list[int]]
    allowed_token_ids_mask: torch.Tensor | None  # bool [num_reqs, vocab]; True = disallowed
    logitsprocs: LogitsProcessors
