"""Verifies drafts by sampling each position in turn with the ordinary sampler.

A draft here is a point mass: the proposer offers one token per position. The
standard rejection rule for it (accept with probability p(draft), else draw
from p with the draft removed, renormalised) gives the same token as drawing
x ~ p and accepting the draft exactly when x equals it: P(accept) = p(draft),
and a rejected x is distributed as p restricted to the other tokens. So each
position is sampled as it would be without speculation, by the same
``Sampler`` (penalties, processors, temperature, top-k/p, min-p), and a
request stops at the first sample that differs from its draft; that sample
is its correction, and a request whose drafts all pass gets one bonus sample.

Positions are sampled one after another, not all at once, because the state
every stateful part of sampling reads advances with each accepted token: the
token is appended to the request's live output list before the next position
is sampled, so penalties count it, logits processors (the grammar, min
tokens, the thinking budget) see it, and seeded generators move to the next
output index. Outputs are therefore exactly those of non-speculative
decoding, even for seeded sampling, at the cost of one sampler pass (and on
CUDA one host sync) per accepted position.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from services.common.engine import Logprobs
from services.common.model_runner_output import RequestFailure
from services.worker.sample import Sampler, SamplingState
from services.worker.sample.sampler import SamplerOutput

# Stands for a token whose row had non-finite logits.
_NONFINITE = -1


@dataclass(slots=True)
class VerifiedRow:
    """One request's samples in a speculative step: accepted drafts, then one more."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: Logprobs | None = None
    failure: RequestFailure | None = None


class RejectionSampler:
    """Samples every position of a step whose requests carry drafts.

    ``logits`` holds each request's positions consecutively, its first at
    ``row_starts[row]``: ``len(drafts[row]) + 1`` rows for a request with
    drafts, one for the others. Only rows with ``sampled[row]`` (their prompt is
    done) are sampled and kept; each sample is appended to the batch row
    (``append``) before the next position is sampled.
    """

    def __init__(self, sampler: Sampler, nonfinite_failure: RequestFailure) -> None:
        self.sampler = sampler
        self.nonfinite_failure = nonfinite_failure

    def __call__(
        self,
        logits: torch.Tensor,
        row_starts: np.ndarray,
        drafts: list[list[int]],
        sampled: np.ndarray,
        sampling_state: SamplingState,
        append: Callable[[int, int], None],
        num_logprobs: list[int | None] | None,
        out: torch.Tensor,
    ) -> list[VerifiedRow | None]:
        """One VerifiedRow per batch row whose sample is kept, else None. ``out``
        ([num_reqs, vocab], float32) receives each position's logits in turn."""
        num_reqs = len(drafts)
        depth = np.fromiter(map(len, drafts), dtype=np.int64, count=num_reqs)
        results: list[VerifiedRow | None] = [VerifiedRow() if s else None for s in sampled]
        active = np.array(sampled, dtype=bool)
        position = 0
        while active.any():
            index = torch.from_numpy(row_starts + np.minimum(position, depth))
            torch.index_select(logits, 0, index.to(logits.device), out=out)
            metadata = sampling_state.make_sampling_metadata(num_reqs)
            output = self.sampler(out, metadata)
            tokens = _host_tokens(output)
            for row in np.flatnonzero(active).tolist():
                result = results[row]
                assert result is not None
                if not self._take(result, row, tokens[row], output, num_logprobs):
                    active[row] = False
                    continue
                append(row, tokens[row])
                if position >= depth[row] or tokens[row] != drafts[row][position]:
                    active[row] = False  # a correction, or the bonus token
            position += 1
        return results

    def _take(self, result: VerifiedRow, row: int, token_id: int, output: SamplerOutput,
              num_logprobs: list[int | None] | None) -> bool:
        """Records one sample of ``row``; False (and the failure) when the row failed."""
        failure = output.row_failures.get(row)
        if failure is None and token_id == _NONFINITE:
            failure = output.nonfinite_reasons.get(row) or self.nonfinite_failure
        if failure is not None:
            result.failure = failure
            return False
        result.token_ids.append(token_id)
        n = num_logprobs[row] if num_logprobs else None
        if n is not None:
            # -1 (whole vocabulary) keeps every column the batch computed.
            position = output.logprobs_for_row(row, n if n >= 0 else None)
            result.logprobs = position if result.logprobs is None else _concat(
                result.logprobs, position)
        return True


def _host_tokens(output: SamplerOutput) -> list[int]:
    """The pass's samples on the host (its one device sync), -1 where not finite."""
    tokens = output.sampled_token_ids
    if output.nonfinite_rows is not None:
        tokens = tokens.masked_fill(output.nonfinite_rows, _NONFINITE)
    return tokens.tolist()


def _concat(a: Logprobs, b: Logprobs) -> Logprobs:
    return Logprobs(token_ids=a.token_ids + b.token_ids, logprobs=a.logprobs + b.logprobs,
                    sampled_token_ranks=a.sampled_token_ranks + b.sampled_token_ranks)
