"""Turns the engine's logprob rows into per-position {token_id: Logprob} dicts."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from services.common.engine import EngineCoreRequest, Logprobs
from services.frontend.outputs import Logprob, PromptLogprobs, SampleLogprobs


class LogprobsProcessor:
    """Sample and prompt logprobs of one request, with decoded token text.

    Row i of an engine ``Logprobs`` is one position: the sampled (or prompt)
    token first, with its rank in the whole vocabulary, then the top-N tokens
    ranked 1..N. ``logprobs`` / ``prompt_logprobs`` / ``cumulative_logprob``
    stay None when the request did not ask for them.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        num_logprobs: int | None,
        num_prompt_logprobs: int | None,
    ) -> None:
        self._tokenizer = tokenizer
        self.logprobs: SampleLogprobs | None = [] if num_logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if num_logprobs is not None else None
        # The first prompt token has nothing before it, hence no logprob.
        self.prompt_logprobs: PromptLogprobs | None = (
            [None] if num_prompt_logprobs is not None else None
        )

    @classmethod
    def from_new_request(
        cls, tokenizer: PreTrainedTokenizerBase | None, request: EngineCoreRequest
    ) -> LogprobsProcessor:
        params = request.sampling_params
        if not params.detokenize:
            tokenizer = None
        return cls(tokenizer, params.logprobs, params.prompt_logprobs)

    def update(
        self,
        new_logprobs: Logprobs | None,
        new_prompt_logprobs: Logprobs | None,
        num_kept_tokens: int,
    ) -> None:
        """Adds the rows of one engine output.

        Only the first ``num_kept_tokens`` sample rows are kept: tokens after a
        stop string were dropped, and so are their logprobs.
        """
        if self.logprobs is not None and new_logprobs is not None:
            for row in range(min(num_kept_tokens, len(new_logprobs))):
                position = self._make_position(new_logprobs, row)
                self.logprobs.append(position)
                self.cumulative_logprob += new_logprobs.logprobs[row][0]
        if self.prompt_logprobs is not None and new_prompt_logprobs is not None:
            for row in range(len(new_prompt_logprobs)):
                self.prompt_logprobs.append(self._make_position(new_prompt_logprobs, row))

    def pop_prompt_logprobs(self) -> PromptLogprobs | None:
        """The prompt logprobs not handed out yet (for DELTA outputs); None if none."""
        if not self.prompt_logprobs:
            return None
        prompt_logprobs, self.prompt_logprobs = self.prompt_logprobs, []
        return prompt_logprobs

    def _make_position(self, rows: Logprobs, row: int) -> dict[int, Logprob]:
        token_ids = rows.token_ids[row]
        logprobs = rows.logprobs[row]
        chosen = token_ids[0]
        position = {
            chosen: Logprob(logprobs[0], rows.sampled_token_ranks[row], self._decode(chosen))
        }
        for rank, (token_id, logprob) in enumerate(zip(token_ids[1:], logprobs[1:]), start=1):
            # The chosen token keeps its own entry when it is also in the top-N.
            if token_id not in position:
                position[token_id] = Logprob(logprob, rank, self._decode(token_id))
        return position

    def _decode(self, token_id: int) -> str | None:
        if self._tokenizer is None:
            return None
        return self._tokenizer.decode([token_id])

