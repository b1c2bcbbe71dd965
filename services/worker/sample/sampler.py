"""Sampler: one token per row from the logits, vLLM V1's step order."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from kernels.argmax_cpu import argmax
from services.common.engine import Logprobs
from services.common.model_runner_output import RequestFailure
from services.worker.sample.logprobs import LogprobsTensors, compute_logprobs, gather_logprobs
from services.worker.sample.ops.penalties import apply_penalties, make_padded_token_ids
from services.worker.sample.ops.topk_topp import apply_top_k_top_p, random_sample
from services.worker.sample.sampling_metadata import SAMPLING_EPS, SamplingMetadata


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # int64 [num_reqs]
    # Set when any row asked for logprobs: N = the largest number asked for.
    logprobs_tensors: LogprobsTensors | None = None
    # bool [num_reqs]: the row's logits were not finite (NaN, +inf, or every
    # token masked); its sample means nothing.
    nonfinite_rows: torch.Tensor | None = None
    # Rows a logits processor could not serve (see LogitsProcessor.take_row_failures).
    row_failures: dict[int, RequestFailure] = field(default_factory=dict)
    # Why a row may be in ``nonfinite_rows`` (LogitsProcessor.nonfinite_reasons).
    nonfinite_reasons: dict[int, RequestFailure] = field(default_factory=dict)
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
    Rows whose logits are not finite where they are sampled (after step 5,
    and for random rows after step 9) are flagged in ``nonfinite_rows``, and
    the rows a processor failed are in ``row_failures``: one request's poison
    never stops the batch. The logits are modified in place. On CUDA the host never waits for the
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
        sampled, nonfinite = self.sample(logits, md)
        logprobs_tensors = None
        if raw_logprobs is not None:
            assert md.max_num_logprobs is not None
            logprobs_tensors = gather_logprobs(raw_logprobs, md.max_num_logprobs, sampled)
        row_failures: dict[int, RequestFailure] = {}
        nonfinite_reasons: dict[int, RequestFailure] = {}
        for proc in md.logitsprocs.all:
            row_failures.update(proc.take_row_failures())
            nonfinite_reasons.update(proc.nonfinite_reasons())
        return SamplerOutput(sampled, logprobs_tensors, nonfinite, row_failures,
                             nonfinite_reasons)

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
    def sample(logits: torch.Tensor, md: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 6-10: int64 ``[num_reqs]`` token ids, and bool ``[num_reqs]``
        flags of the rows whose logits are not finite where they are sampled."""
        if md.all_random:
            assert md.temperature is not None
            nonfinite = _nonfinite_rows(logits)
            return Sampler.sample_random(logits, md, md.temperature, nonfinite), nonfinite
        greedy = argmax(logits)
        # argmax lands on a row's first NaN, else on its maximum, so the value
        # there is what _nonfinite_rows' max would be: no second pass.
        nonfinite = ~torch.isfinite(logits.gather(-1, greedy[:, None]).squeeze(-1))
        if md.all_greedy:
            return greedy, nonfinite
        assert md.temperature is not None
        is_greedy = md.temperature < SAMPLING_EPS
        # Greedy rows divide by 1: their random sample is discarded anyway.
        temperature = torch.where(is_greedy, 1.0, md.temperature)
        random_rows_nonfinite = torch.zeros_like(nonfinite)
        sampled = Sampler.sample_random(logits, md, temperature, random_rows_nonfinite)
        nonfinite |= random_rows_nonfinite & ~is_greedy
        return torch.where(is_greedy, greedy, sampled), nonfinite

    @staticmethod
    def sample_random(
        logits: torch.Tensor, md: SamplingMetadata, temperature: torch.Tensor,
        nonfinite: torch.Tensor,
    ) -> torch.Tensor:
        """Steps 7-10 for every row; ORs rows left non-finite into ``nonfinite``."""
        logits.div_(temperature.unsqueeze(1))
        for proc in md.logitsprocs.argmax_invariant:
            logits = proc.apply(logits)
        logits = apply_top_k_top_p(logits, md.top_k, md.top_p, md.max_top_k)
        nonfinite |= _nonfinite_rows(logits)
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        return random_sample(probs, md.generators)


def _nonfinite_rows(logits: torch.Tensor) -> torch.Tensor:
    """bool ``[num_reqs]``: rows holding a NaN or +inf, or masked everywhere.

    One max per row: NaN and +inf propagate to it, and -inf is its value only
    when every token is masked.
    """
    return ~torch.isfinite(logits.amax(dim=-1))
