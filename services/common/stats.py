"""`SchedulerStats`: one worker's scheduling and KV cache figures (GetStats, metrics)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from services.common.model_runner_output import ModelRunnerOutput


@dataclass(slots=True)
class SpecDecodingStats:
    """Speculative decoding's counters, cumulative (vLLM's SpecDecodingStats).

    A draft is one request's drafts verified in one step; its accepted tokens
    are the leading drafts the target model agreed with.
    ``num_accepted_tokens_per_pos[i]`` counts drafts whose token ``i`` was accepted.
    """

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @classmethod
    def new(cls, num_spec_tokens: int) -> SpecDecodingStats:
        return cls(num_spec_tokens, num_accepted_tokens_per_pos=[0] * num_spec_tokens)

    def observe(self, output: ModelRunnerOutput) -> None:
        """Counts the drafts a step verified (the sampled tokens are the accepted
        drafts, then one more)."""
        per_pos = self.num_accepted_tokens_per_pos
        for req_id, sampled in zip(output.req_ids, output.sampled_token_ids):
            num_drafts = output.num_draft_tokens.get(req_id, 0)
            if not num_drafts:
                continue
            num_accepted = min(len(sampled) - 1, num_drafts)
            self.num_drafts += 1
            self.num_draft_tokens += num_drafts
            self.num_accepted_tokens += num_accepted
            for pos in range(min(num_accepted, len(per_pos))):
                per_pos[pos] += 1

    def copy(self) -> SpecDecodingStats:
        return dataclasses.replace(
            self, num_accepted_tokens_per_pos=list(self.num_accepted_tokens_per_pos))

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verified draft, the sampled one included (1.0 = nothing accepted)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass(slots=True)
class SchedulerStats:
    """A snapshot of one worker's scheduler; counters are cumulative since it registered.

    The fields after ``prefix_cache_hits`` are filled by the scheduler
    service's worker session (the offline engine leaves their defaults):
    the generation history always, the block map only when asked for.
    """

    num_running_reqs: int
    num_waiting_reqs: int
    num_total_blocks: int  # usable blocks: the null block is not counted
    num_free_blocks: int
    num_cached_blocks: int
    kv_cache_usage: float  # 0..1
    num_preemptions: int  # cumulative
    prefix_cache_queries: int  # cumulative, in tokens
    prefix_cache_hits: int  # cumulative, in tokens
    num_evicted_blocks: int = 0  # cumulative
    num_generation_tokens: int = 0  # cumulative
    generation_tokens_per_s: list[float] = field(default_factory=list)  # oldest first
    history_interval_s: float = 0.0
    block_map: bytes = b""  # see kvmesh.v1.WorkerStats.block_map
    blocks_per_cell: int = 0
    num_cached_free_blocks: int = 0  # filled with the block map
    spec_decoding: SpecDecodingStats | None = None  # None: the worker does not draft

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
