"""What the scheduler keeps for its metrics and the dashboard: per-request phase times,
evictions, the block map and the token-rate history."""

from __future__ import annotations

import pytest

from services.common.engine import EngineCoreRequest
from services.common.model_runner_output import ModelRunnerOutput
from services.common.sampling_params import SamplingParams
from services.scheduler.block_map import CACHED_FREE, FREE, USED, make_block_map
from services.scheduler.config import SchedulerConfig
from services.scheduler.kv_store import InMemoryKVStore
from services.scheduler.scheduler import Scheduler
from services.scheduler.token_rate import TokenRateHistory


def request(req_id: str, prompt: list[int], max_tokens: int) -> EngineCoreRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return EngineCoreRequest(req_id, prompt, params)


def step(scheduler: Scheduler, token_id: int = 7) -> None:
    """One step in which every request that reached its last prompt token samples ``token_id``."""
    output = scheduler.schedule()
    sampled = []
    for req_id in output.num_scheduled_tokens:
        r = scheduler.requests[req_id]
        sampled.append([token_id] if r.num_computed_tokens >= r.num_tokens else [])
    scheduler.update_from_output(output, ModelRunnerOutput(
        step_id=output.step_id, req_ids=list(output.num_scheduled_tokens),
        sampled_token_ids=sampled))


def test_finished_requests_leave_their_phase_times_with_log_stats():
    scheduler = Scheduler(SchedulerConfig(num_blocks=11), InMemoryKVStore(), log_stats=True)
    scheduler.add_request(request("a", list(range(1, 21)), max_tokens=3))
    while scheduler.has_unfinished_requests():
        step(scheduler)
    (times,) = scheduler.finished_req_times
    assert times.queue_time_s >= 0 and times.prefill_time_s >= 0 and times.decode_time_s >= 0
    assert Scheduler(SchedulerConfig(num_blocks=11)).finished_req_times is None  # off by default


def test_block_map_shows_used_cached_and_free_blocks_and_evictions():
    block_size = 16
    scheduler = Scheduler(SchedulerConfig(num_blocks=5, block_size=block_size, max_model_len=64))
    pool = scheduler.kv_cache_manager.block_pool
    scheduler.add_request(request("a", list(range(1, 2 * block_size + 2)), max_tokens=2))
    step(scheduler)  # prefill: 3 blocks, the first two full and cached
    assert make_block_map(pool).cells == bytes([USED, USED, USED, FREE])
    step(scheduler)  # finishes: its blocks are freed, the full ones stay cached
    block_map = make_block_map(pool)
    assert block_map.cells.count(CACHED_FREE) == block_map.num_cached_free_blocks == 2
    assert block_map.cells.count(USED) == 0
    # A request with another prefix takes all 4 blocks: both cached ones are evicted.
    scheduler.add_request(request("b", list(range(100, 100 + 3 * block_size + 2)), max_tokens=2))
    step(scheduler)
    assert make_block_map(pool).cells == bytes([USED] * 4)
    assert scheduler.make_stats().num_evicted_blocks == 2


def test_block_map_groups_blocks_per_cell_keeping_the_most_used():
    scheduler = Scheduler(SchedulerConfig(num_blocks=11, block_size=4))
    scheduler.add_request(request("a", [1, 2, 3], max_tokens=2))
    step(scheduler)  # holds block 1 only
    block_map = make_block_map(scheduler.kv_cache_manager.block_pool, max_cells=4)
    assert block_map.blocks_per_cell == 3
    assert block_map.cells == bytes([USED, FREE, FREE, FREE])
    with pytest.raises(ValueError, match="max_cells is 0"):
        make_block_map(scheduler.kv_cache_manager.block_pool, max_cells=0)


def test_token_rate_history_reports_complete_intervals_and_idle_ones():
    history = TokenRateHistory(interval_s=2.0, num_intervals=3)
    history.add(10, now=100.0)
    history.add(6, now=101.0)
    assert history.rates(now=101.5) == []  # the first interval is still filling
    history.add(4, now=102.5)
    assert history.rates(now=103.0) == [8.0]
    assert history.rates(now=107.0) == [8.0, 2.0, 0.0]  # an idle interval counts 0
    assert history.rates(now=200.0) == [0.0, 0.0, 0.0]  # only the last 3 are kept
    with pytest.raises(ValueError, match="interval_s is 0"):
        TokenRateHistory(interval_s=0)
