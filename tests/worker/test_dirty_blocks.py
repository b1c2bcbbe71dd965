"""DirtyBlockLog: which blocks a worker reports as possibly overwritten when it registers."""

from __future__ import annotations

from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from services.worker.dirty_blocks import DirtyBlockLog


def step(step_id: int, durable: int, new: list[int] = (), cached: list[int] = ()) -> SchedulerOutput:
    new_reqs = [NewRequestData("n", [1], SamplingParams(), list(new), 0)] if new else []
    return SchedulerOutput(
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=CachedRequestData(["c"], [False], [list(cached)], [0]),
        step_id=step_id, durable_step_id=durable)


def test_blocks_are_dirty_until_a_step_says_the_mirror_covers_them():
    log = DirtyBlockLog()
    log.record(step(1, -1, new=[3, 4]))
    log.record(step(2, -1, cached=[5]))
    assert log.dirty_block_ids() == [3, 4, 5]
    log.record(step(3, 1, cached=[6]))  # steps <= 1 are durable now
    assert log.dirty_block_ids() == [5, 6]
    log.record(step(4, 3))
    assert log.dirty_block_ids() == []


def test_a_new_registration_keeps_the_old_log_until_its_first_durable_state():
    log = DirtyBlockLog()
    log.record(step(7, 5, new=[9]))
    log.start_registration()  # the next scheduler numbers its steps from 1 again
    log.record(step(1, -1, new=[2]))
    assert log.dirty_block_ids() == [2, 9]
    log.record(step(2, 0))  # its recovery state (step 0) is durable: block 9 is covered
    assert log.dirty_block_ids() == [2]
