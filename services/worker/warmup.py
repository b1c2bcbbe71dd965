"""Warm-up steps that compile the CPU worker's pieces before it registers.

torch.compile builds on first use. A worker that compiled during its first
real step would stall that request for as long as inductor takes (tens of
seconds cold), so, as vLLM's ``compile_or_warm_up_model``, the worker runs a
few made-up steps first: a prefill of two requests (the multi-token graphs
and the prefill attention), a decode of both (the dynamic decode kernel) and a
decode of one (torch's batch-of-one specialization). They write garbage K/V
into blocks 1 and 2 only, which no request owns yet; block 0, the null block,
is never touched.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

if TYPE_CHECKING:
    from services.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)
_PROMPT_LEN = 3
_REQ_IDS = ("warmup-0", "warmup-1")
# Blocks 0 (null) and the two written here.
MIN_WARM_UP_BLOCKS = 3


def _steps() -> list[SchedulerOutput]:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = list(range(1, _PROMPT_LEN + 1))
    new = [NewRequestData(req_id, prompt, params, [block_id], 0)
           for block_id, req_id in enumerate(_REQ_IDS, start=1)]
    prefill = SchedulerOutput(scheduled_new_reqs=new,
                              num_scheduled_tokens={r: _PROMPT_LEN for r in _REQ_IDS},
                              total_num_scheduled_tokens=2 * _PROMPT_LEN)
    # Each request's prompt and two decoded tokens fit its one block.
    decode_two = SchedulerOutput(
        scheduled_cached_reqs=CachedRequestData(list(_REQ_IDS), [False, False], [[], []],
                                                [_PROMPT_LEN, _PROMPT_LEN]),
        num_scheduled_tokens={r: 1 for r in _REQ_IDS}, total_num_scheduled_tokens=2)
    decode_one = SchedulerOutput(
        scheduled_cached_reqs=CachedRequestData([_REQ_IDS[0]], [False], [[]], [_PROMPT_LEN + 1]),
        num_scheduled_tokens={_REQ_IDS[0]: 1}, total_num_scheduled_tokens=1,
        finished_req_ids={_REQ_IDS[1]})
    finish = SchedulerOutput(finished_req_ids={_REQ_IDS[0]})
    return [prefill, decode_two, decode_one, finish]


def warm_up_model(runner: ModelRunner, block_size: int, num_blocks: int) -> None:
    """Runs the warm-up steps on ``runner``; the runner ends with no requests. Does
    nothing where they do not fit: fewer than ``MIN_WARM_UP_BLOCKS`` KV blocks, two
    batch rows, six tokens per step, or a block or model length under five tokens."""
    fits = (num_blocks >= MIN_WARM_UP_BLOCKS and runner.input_batch.max_num_reqs >= 2
            and runner.max_num_batched_tokens >= 2 * _PROMPT_LEN
            and min(block_size, runner.max_model_len) >= _PROMPT_LEN + 2)
    if not fits:
        return
    start = time.perf_counter()
    for scheduler_output in _steps():
        runner.execute_model(scheduler_output)
    logger.info("event=worker_warmed_up seconds=%.1f", time.perf_counter() - start)
