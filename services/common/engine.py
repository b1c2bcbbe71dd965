"""Requests and outputs exchanged between the frontend and the engine core."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from services.common.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    """Why a request finished; values match kvmesh.v1.FinishReason."""

    STOP = 1  # EOS, a stop token or a stop string
    LENGTH = 2  # max_tokens, max_model_len, or a prompt that can never fit
    ABORT = 3

    def __str__(self) -> str:
        return self.name.lower()


@dataclass(slots=True)
class Logprobs:
    """Logprobs for a run of positions: row i is position i.

    The first entry of each row is the sampled (or prompt) token, followed by
    the top-N tokens; ``sampled_token_ranks[i]`` is the first entry's rank in
    the whole vocabulary (1 = most likely).
    """

    token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    sampled_token_ranks: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

    def extend(self, other: "Logprobs") -> None:
        self.token_ids.extend(other.token_ids)
        self.logprobs.extend(other.logprobs)
        self.sampled_token_ranks.extend(other.sampled_token_ranks)


@dataclass(slots=True)
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    priority: int = 0  # lower runs first under the priority policy
    cache_salt: str | None = None
    client_index: int = 0
    # Generated before this submission (resubmitted after a scheduler
    # restart): the engine recomputes them and continues after them.
    output_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: Logprobs | None = None
    new_prompt_logprobs: Logprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    finish_message: str = ""
    # A grpc.StatusCode value when the engine refused the request, else 0.
    status_code: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    engine_index: int = 0
    timestamp: float = 0.0
