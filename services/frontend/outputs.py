"""What the frontend hands its callers: vLLM's RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass

from services.frontend.metrics import RequestStateStats


@dataclass(slots=True)
class Logprob:
    """One token's logprob at one position; rank 1 is the most likely token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: {token_id: Logprob}. Prompt logprobs start with None
# for the first prompt token, which has nothing to be conditioned on.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence (one of the n of a request).

    In DELTA mode ``text``, ``token_ids`` and ``logprobs`` hold only what is new
    since the previous output; otherwise everything so far.
    ``finish_reason`` is "stop", "length" or "abort" once finished, else None;
    ``stop_reason`` is the stop string or stop token id that ended it (None for
    EOS). ``finish_message`` says why the engine refused a request it could
    never run (e.g. a prompt larger than the KV cache).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    finish_message: str = ""

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """The state of one client request; ``request_id`` is the client's id."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestStateStats | None = None
