"""What verifying drafts costs on this machine, measured before the worker registers.

A step that verifies d drafts computes 1 + d positions of the model and of the
LM head. Where a step's time is the time to read the weights, d is almost
free; where the matrix units' work grows with the rows (bfloat16 or int8 on a
CPU without native support for them), a step with 5 drafts can cost 3-4 steps
without (benchmarks/RESULTS.md). So the worker times real one-request steps
with 0 to k made-up drafts, on its own model, dtype and threads, and the
Drafter drafts only where the expected accepted tokens repay that cost.

The probe writes garbage K/V into blocks from 1 on, which no request owns yet
(as the warm-up does); block 0, the null block, is never touched.
"""

from __future__ import annotations

import itertools
import logging
import statistics
import time
from typing import TYPE_CHECKING

from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

if TYPE_CHECKING:
    from services.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)
_REQ_ID = "calibrate-drafts"
_PROMPT_LEN = 32
_DRAFT_TOKEN = 3  # any id: the probe measures time, not what is accepted


def measure_step_costs(runner: ModelRunner, block_size: int, num_blocks: int,
                       num_speculative_tokens: int, repeats: int = 3) -> list[float] | None:
    """``costs[d]``: the median time of a one-request step verifying d drafts over that
    of one verifying none, d = 0..k (a first untimed round compiles the new
    shapes), made non-decreasing from 1.0. None where the probe does not fit the
    pool, the batch or the model."""
    k = num_speculative_tokens
    num_steps = (repeats + 1) * (k + 1)
    max_len = _PROMPT_LEN + num_steps * (k + 1) + 1
    num_probe_blocks = -(-max_len // block_size)
    if (runner.drafter is None or max_len > runner.max_model_len
            or num_blocks <= num_probe_blocks or runner.max_num_batched_tokens < _PROMPT_LEN):
        return None
    params = SamplingParams(temperature=0.0, max_tokens=max_len, ignore_eos=True)
    new = NewRequestData(_REQ_ID, list(range(1, _PROMPT_LEN + 1)), params,
                         list(range(1, 1 + num_probe_blocks)), 0)
    runner.execute_model(SchedulerOutput(scheduled_new_reqs=[new],
                                         num_scheduled_tokens={_REQ_ID: _PROMPT_LEN},
                                         total_num_scheduled_tokens=_PROMPT_LEN))
    times: dict[int, list[float]] = {d: [] for d in range(k + 1)}
    for round_ in range(repeats + 1):
        for d in range(k + 1):
            elapsed = _timed_step(runner, d)
            if round_:
                times[d].append(elapsed)
    runner.execute_model(SchedulerOutput(finished_req_ids={_REQ_ID}))
    base = statistics.median(times[0])
    # Checking more drafts never costs less: what says otherwise is noise (a
    # shared machine), which must not make drafts look free.
    costs = list(itertools.accumulate(
        (max(statistics.median(times[d]) / base, 1.0) for d in range(k + 1)), max))
    logger.info("event=draft_costs_measured step_ms=%.2f costs=%s", base * 1e3,
                ",".join(f"{c:.2f}" for c in costs))
    return costs


def _timed_step(runner: ModelRunner, num_drafts: int) -> float:
    state = runner.requests[_REQ_ID]
    assert state.drafts is not None
    state.drafts.token_ids = [_DRAFT_TOKEN] * num_drafts
    cached = CachedRequestData([_REQ_ID], [False], [[]], [state.num_tokens - 1])
    step = SchedulerOutput(scheduled_cached_reqs=cached,
                           num_scheduled_tokens={_REQ_ID: 1 + num_drafts},
                           total_num_scheduled_tokens=1 + num_drafts,
                           num_draft_tokens={_REQ_ID: num_drafts} if num_drafts else {})
    start = time.perf_counter()
    runner.execute_model(step)
    return time.perf_counter() - start
