"""SchedulingLimits: one definition of max_num_seqs / max_num_batched_tokens for every service."""

from __future__ import annotations

import pytest

from services.common.limits import SchedulingLimits
from services.common.registration import WorkerRegistration
from services.scheduler.config import SchedulingOptions, make_scheduler_config
from services.scheduler.server import parse_args as parse_scheduler_args
from services.worker.server import parse_args as parse_worker_args


@pytest.mark.parametrize(("field", "value"), [("max_num_seqs", 0), ("max_num_batched_tokens", -1),
                                               ("max_num_seqs", True), ("max_num_seqs", 2.5)])
def test_bad_limits_name_the_field_and_range(field: str, value) -> None:
    with pytest.raises(ValueError, match=f"{field} is {value!r}, must be an integer >= 1"):
        SchedulingLimits(**{field: value})


def test_capped_by_takes_each_minimum() -> None:
    ours = SchedulingLimits(max_num_seqs=64, max_num_batched_tokens=512)
    theirs = SchedulingLimits(max_num_seqs=8, max_num_batched_tokens=4096)
    assert ours.capped_by(theirs) == SchedulingLimits(max_num_seqs=8, max_num_batched_tokens=512)
    assert ours.capped_by(None) is ours


def test_scheduler_and_worker_command_lines_share_the_flags() -> None:
    argv = ["--max-num-seqs", "7", "--max-num-batched-tokens", "96"]
    scheduler_config, _ = parse_scheduler_args(argv)
    worker_config, _ = parse_worker_args(argv)
    expected = SchedulingLimits(max_num_seqs=7, max_num_batched_tokens=96)
    assert scheduler_config.scheduling.limits == expected
    assert worker_config.worker.limits == expected
    default_scheduler, _ = parse_scheduler_args([])
    default_worker, _ = parse_worker_args([])
    assert default_scheduler.scheduling.limits == default_worker.worker.limits == SchedulingLimits()


def test_one_function_configures_a_workers_scheduler() -> None:
    options = SchedulingOptions(limits=SchedulingLimits(max_num_seqs=32), policy="priority",
                                long_prefill_token_threshold=64, max_num_waiting=5,
                                enable_prefix_caching=False)
    worker = WorkerRegistration("w", "m", "float32", 16, 100, 512, 256, [2],
                                SchedulingLimits(max_num_seqs=48, max_num_batched_tokens=256))
    config = make_scheduler_config(options, worker, engine_index=3)
    assert config.limits == SchedulingLimits(max_num_seqs=32, max_num_batched_tokens=256)
    assert (config.num_blocks, config.block_size, config.max_model_len, config.engine_index) == (
        100, 16, 512, 3)
    assert (config.policy.value, config.long_prefill_token_threshold, config.max_num_waiting,
            config.enable_prefix_caching) == ("priority", 64, 5, False)
