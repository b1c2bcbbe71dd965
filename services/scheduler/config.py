"""Scheduler configuration (one block pool, one worker)."""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.request_queue import SchedulingPolicy


@dataclass(slots=True, kw_only=True)
class SchedulerConfig:
    """Limits of one scheduling loop.

    ``num_blocks`` is what the worker reported and INCLUDES the null block 0,
    so ``num_blocks - 1`` blocks can hold KV. Every field is validated on
    construction; a bad value raises ``ValueError`` naming the field and the
    allowed range.
    """

    num_blocks: int
    block_size: int = 16
    max_num_batched_tokens: int = 2048  # the per-step token budget
    max_num_seqs: int = 128  # most requests running at once
    max_model_len: int = 2048  # prompt + output tokens of one request
    long_prefill_token_threshold: int = 0  # most tokens of one request per step; 0 = off
    policy: SchedulingPolicy | str = SchedulingPolicy.FCFS
    enable_prefix_caching: bool = True
    engine_index: int = 0
    max_num_waiting: int = 0  # bound on the waiting queue; 0 = unbounded

    def __post_init__(self) -> None:
        _check_at_least("num_blocks", self.num_blocks, 2)
        _check_at_least("block_size", self.block_size, 1)
        _check_at_least("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_at_least("max_num_seqs", self.max_num_seqs, 1)
        # One prompt token plus one generated token is the smallest useful request.
        _check_at_least("max_model_len", self.max_model_len, 2)
        _check_at_least("long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        _check_at_least("engine_index", self.engine_index, 0)
        _check_at_least("max_num_waiting", self.max_num_waiting, 0)
        try:
            self.policy = SchedulingPolicy(self.policy)
        except ValueError:
            allowed = ", ".join(repr(p.value) for p in SchedulingPolicy)
            raise ValueError(f"policy is {self.policy!r}, allowed: {allowed}") from None

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can hold KV (all but the null block)."""
        return self.num_blocks - 1


def _check_at_least(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} is {value!r}, must be an integer >= {minimum}")
