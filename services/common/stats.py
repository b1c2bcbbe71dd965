"""`SchedulerStats`: one worker's scheduling and KV cache figures (GetStats, metrics)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SchedulerStats:
    """A snapshot of one worker's scheduler; counters are cumulative since it registered."""

    num_running_reqs: int
    num_waiting_reqs: int
    num_total_blocks: int  # usable blocks: the null block is not counted
    num_free_blocks: int
    num_cached_blocks: int
    kv_cache_usage: float  # 0..1
    num_preemptions: int  # cumulative
    prefix_cache_queries: int  # cumulative, in tokens
    prefix_cache_hits: int  # cumulative, in tokens

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
