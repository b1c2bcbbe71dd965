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

    def add(self, newer: RequestOutput, aggregate: bool) -> None:
        """Folds ``newer``, the next output of the same request, into this one
        (vLLM's RequestOutput.add). ``aggregate`` (DELTA outputs): each
        sequence's new text, token ids and logprobs are appended; otherwise
        the newer sequences replace the older ones."""
        self.finished |= newer.finished
        self.num_cached_tokens = newer.num_cached_tokens
        self.metrics = newer.metrics
        if newer.prompt_logprobs is not None:
            self.prompt_logprobs = newer.prompt_logprobs
        outputs = list(self.outputs)  # the list may be the caller's
        by_index = {completion.index: i for i, completion in enumerate(outputs)}
        for completion in newer.outputs:
            i = by_index.get(completion.index)
            if i is None:
                by_index[completion.index] = len(outputs)
                outputs.append(completion)
            elif aggregate:
                outputs[i] = _concatenated(outputs[i], completion)
            else:
                outputs[i] = completion
        self.outputs = outputs


def _concatenated(older: CompletionOutput, newer: CompletionOutput) -> CompletionOutput:
    """One DELTA output holding ``older``'s new tokens followed by ``newer``'s."""
    if older.logprobs is None or newer.logprobs is None:
        logprobs = older.logprobs if newer.logprobs is None else newer.logprobs
    else:
        logprobs = older.logprobs + newer.logprobs
    return CompletionOutput(
        index=older.index, text=older.text + newer.text,
        token_ids=older.token_ids + newer.token_ids,
        cumulative_logprob=newer.cumulative_logprob, logprobs=logprobs,
        finish_reason=newer.finish_reason, stop_reason=newer.stop_reason,
        finish_message=newer.finish_message,
    )
