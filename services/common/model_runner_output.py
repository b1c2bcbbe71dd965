"""What a worker returns for one step (vLLM V1's ModelRunnerOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from services.common.engine import Logprobs

# A failure's message reaches the client; the worker cuts longer ones.
MAX_FAILURE_MESSAGE_CHARS = 1000
# What a worker may say about one request it dropped: the request's own
# arguments were refused, or computing it failed.
FAILURE_STATUS_CODES = frozenset(
    code.value[0] for code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL)
)


@dataclass(slots=True, frozen=True)
class RequestFailure:
    """Why a worker dropped one request: a grpc.StatusCode value and a message."""

    status_code: int
    message: str

    @classmethod
    def of(cls, code: grpc.StatusCode, message: str) -> RequestFailure:
        return cls(code.value[0], message[:MAX_FAILURE_MESSAGE_CHARS])


@dataclass(slots=True)
class ModelRunnerOutput:
    """Per-request results of one step.

    ``sampled_token_ids[i]`` belongs to ``req_ids[i]`` and is empty when the
    request was only partway through its prompt (the sample is discarded).
    ``logprobs`` and ``prompt_logprobs`` hold entries only for requests that
    asked for them. ``failed`` holds the requests of the step the worker
    could not serve and has dropped; they appear nowhere else.
    ``num_draft_tokens`` holds, for each request that verified drafts, how
    many: its sampled tokens are the drafts accepted, then one more.
    """

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: dict[str, Logprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, Logprobs] = field(default_factory=dict)
    step_id: int = 0
    failed: dict[str, RequestFailure] = field(default_factory=dict)
    num_draft_tokens: dict[str, int] = field(default_factory=dict)
