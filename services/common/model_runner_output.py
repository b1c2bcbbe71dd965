"""What a worker returns for one step (vLLM V1's ModelRunnerOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.engine import Logprobs


@dataclass(slots=True)
class ModelRunnerOutput:
    """Per-request results of one step.

    ``sampled_token_ids[i]`` belongs to ``req_ids[i]`` and is empty when the
    request was only partway through its prompt (the sample is discarded).
    ``logprobs`` and ``prompt_logprobs`` hold entries only for requests that
    asked for them.
    """

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: dict[str, Logprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, Logprobs] = field(default_factory=dict)
    step_id: int = 0
