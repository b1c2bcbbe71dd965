"""`SchedulerStats`: one worker's scheduling and KV cache figures (GetStats, metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field


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

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
