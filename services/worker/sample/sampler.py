"""Sampler: one token per row from the logits, vLLM V1's step order."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from services.common.engine import Logprobs
from services.worker.sample.logprobs import LogprobsTensors, compute_logprobs, gather_logprobs
from services.worker.sample.ops.penalties import apply_penalties, make_padded_token_ids
from services.worker.sample.ops.topk_topp import apply_top_k_top_p, random_sample
from services.worker.sample.sampling_metadata import SAMPLING_EPS, SamplingMetadata


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # int64 [num_reqs]
    # Set when any row asked for logprobs: N = the largest number asked for.
    logprobs_tensors: LogprobsTensors | None = None
    _logprobs_lists: Logprobs | None = field(default=None, init=False, repr=False)

    def logprobs_for_row(self, row: int, num_logprobs: int | None = None) -> Logprobs:
        """Row ``row``'s logprobs as one position: sampled token first, then the top-N.

        ``num_logprobs`` keeps only the request's own top-N (the batch computes
        the largest N asked). The first call copies every row to the host once.
        """
        if self.logprobs_tensors is None:
            raise ValueError("no row of this batch asked for logprobs")
        if self._logprobs_lists is None:
            self._logprobs_lists = self.logprobs_tensors.to_logprobs()
        lists = self._logprobs_lists
        end = None if num_logprobs is None else num_logprobs + 1
        return Logprobs(
            token_ids=[lists.token_ids[row][:end]],
            logprobs=[lists.logprobs[row][:end]],
            sampled_token_ranks=[lists.sampled_token_ranks[row]],
        )


class Sampler(nn.Module):
    """Samples the next token of every row, with these steps in order:

    1. If any row asked for logprobs, compute them from the raw logits, before
       any processing (vLLM's ``raw_logprobs`` mode).
    2. Convert the logits to float32.
    3. Apply the allowed-token-ids mask.
    4. Apply the processors that can change the argmax: min tokens, logit
       bias, the thinking budget, then custom ones.
    5. Apply penalties: repetition, frequency, presence.
    6. Greedy-sample (argmax) unless every row is random; if every row is
       greedy, stop here.
    7. Divide by the temperature (greedy rows by 1).
    8. Apply the argmax-invariant processors (min-p, then custom ones).
    9. Apply top-k, then top-p.
    10. Random-sample with an exponential race: seeded rows draw their noise
        from their own generator (positioned by SamplingState for the output
        index being sampled), the other rows share one batched draw. Greedy
        rows keep their step-6 token.
    11. If logprobs were asked for, gather the sampled token's logprob and
        rank and the top-N of step 1's logprobs.
    The logits are modified in place. On CUDA the host never waits for the
    device here; penalties upload the output token lists each step.
    """

    def forward(self, logits: torch.Tensor, sampling_metadata: SamplingMetadata) -> SamplerOutput:
        md = sampling_metadata
        raw_logprobs = compute_logprobs(logits) if md.max_num_logprobs is not None else None
        logits = logits.to(torch.float32)
        if md.allowed_token_ids_mask is not None:
            logits.masked_fill_(md.allowed_token_ids_mask, float("-inf"))
        for proc in md.logitsprocs.non_argmax_invariant:
            logits = proc.apply(logits)
        if not md.no_penalties:
            logits = self.apply_penalties(logits, md)
        sampled = self.sample(logits, md)
        logprobs_tensors = None
        if raw_logprobs is not None:
            assert md.max_num_logprobs is not None
            logprobs_tensors = gather_logprobs(raw_logprobs, md.max_num_logprobs, sampled)
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=logprobs_tensors)

    @staticmethod
    def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        assert md.prompt_token_ids is not None
        vocab_size = logits.shape[1]
        output_token_ids = make_padded_token_ids(
            md.output_token_ids, vocab_size, logits.device, pin_memory=logits.is_cuda
        )
        return apply_penalties(
            logits,
            md.prompt_token_ids,
            output_token_ids,
            md.presence_penalties,
            md.frequency_penalties,
            md.repetition_penalties,
        )

    @staticmethod
    def sample(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Steps 6-10: int64 ``[num_reqs]`` token ids."""
        if md.all_random:
            assert md.temperature is not None
            return Sampler.sample_random(logits, md, md.temperature)
        greedy = logits.argmax(dim=-1)
        if md.all_greedy:
            return greedy
        assert md.temperature is not None
        is_greedy = md.temperature < SAMPLING_EPS
        # Greedy rows divide by 1: their random sample is discarded anyway.
        temperature = torch.where(is_greedy, 1.0, md.temperature)
        return torch.where(is_greedy, greedy, Sampler.sample_random(logits, md, temperature))

    @staticmethod
    def sample_random(
        logits: torch.Tensor, md: SamplingMetadata, temperature: torch.Tensor
    ) -> torch.Tensor:
        """Steps 7-10 for every row."""
        logits.div_(temperature.unsqueeze(1))
        for proc in md.logitsprocs.argmax_invariant:
            logits = proc.apply(logits)
        logits = apply_top_k_top_p(logits, md.top_k, md.top_p, md.max_top_k)
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        return random_sample(probs, md.generators)
