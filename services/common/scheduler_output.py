"""What the scheduler hands a worker each step (vLLM V1's SchedulerOutput).

New requests travel in full; requests the worker already holds travel as a diff.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # Tokens generated before this placement (recompute after a lost worker).
    output_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class CachedRequestData:
    """Parallel lists, one entry per request the worker already holds.

    ``new_block_ids[i]`` is appended to the request's block ids, except when
    ``resumed_from_preemption[i]``: then it replaces them.
    """

    req_ids: list[str] = field(default_factory=list)
    resumed_from_preemption: list[bool] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    finished_req_ids: set[str] = field(default_factory=set)
    step_id: int = 0
    # The newest step whose block changes the scheduler's mirror holds
    # durably; -1: none since the worker registered.
    durable_step_id: int = -1
    # Draft budget per decoding request (speculative decoding): its
    # num_scheduled_tokens is 1 + this, slots allocated; absent = 0.
    num_draft_tokens: dict[str, int] = field(default_factory=dict)
