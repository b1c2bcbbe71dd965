"""Warm-up steps that compile the CPU worker's pieces before it registers.

torch.compile builds on first use. A worker that compiled during its first
real step would stall that request for as long as inductor takes (tens of
seconds cold), so, as vLLM's ``compile_or_warm_up_model``, the worker runs a
few made-up steps first: a prefill of two requests, one of them at least
``DEQUANTIZE_MIN_ROWS`` tokens long (the multi-token graphs, both int8 paths,
the prefill attention), a decode of both (the dynamic decode kernel) and a
decode of one (torch's batch-of-one specialization). They write garbage K/V
into blocks from 1 on, which no request owns yet; block 0, the null block, is
never touched.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from services.worker.layers.quantization import DEQUANTIZE_MIN_ROWS

if TYPE_CHECKING:
    from services.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)
_PROMPT_LENS = (DEQUANTIZE_MIN_ROWS + 2, 3)
_REQ_IDS = ("warmup-0", "warmup-1")
_NUM_DECODES = 2  # tokens each request gets after its prompt


def _blocks_needed(block_size: int) -> list[int]:
    return [-(-(n + _NUM_DECODES) // block_size) for n in _PROMPT_LENS]


def _steps(block_size: int) -> list[SchedulerOutput]:
    params = SamplingParams(temperature=0.0, max_tokens=_NUM_DECODES + 1, ignore_eos=True)
    new, first_block = [], 1  # block 0 is the null block
    for req_id, prompt_len, num_blocks in zip(_REQ_IDS, _PROMPT_LENS, _blocks_needed(block_size)):
        block_ids = list(range(first_block, first_block + num_blocks))
        new.append(NewRequestData(req_id, list(range(1, prompt_len + 1)), params, block_ids, 0))
        first_block += num_blocks
    prefill = SchedulerOutput(scheduled_new_reqs=new,
                              num_scheduled_tokens=dict(zip(_REQ_IDS, _PROMPT_LENS)),
                              total_num_scheduled_tokens=sum(_PROMPT_LENS))
    decode_two = SchedulerOutput(
        scheduled_cached_reqs=CachedRequestData(list(_REQ_IDS), [False, False], [[], []],
                                                list(_PROMPT_LENS)),
        num_scheduled_tokens={r: 1 for r in _REQ_IDS}, total_num_scheduled_tokens=2)
    decode_one = SchedulerOutput(
        scheduled_cached_reqs=CachedRequestData([_REQ_IDS[0]], [False], [[]],
                                                [_PROMPT_LENS[0] + 1]),
        num_scheduled_tokens={_REQ_IDS[0]: 1}, total_num_scheduled_tokens=1,
        finished_req_ids={_REQ_IDS[1]})
    finish = SchedulerOutput(finished_req_ids={_REQ_IDS[0]})
    return [prefill, decode_two, decode_one, finish]


def warm_up_model(runner: ModelRunner, block_size: int, num_blocks: int) -> None:
    """Runs the warm-up steps on ``runner``; the runner ends with no requests. Does
    nothing where they do not fit: too few KV blocks or batch rows, a token budget
    under the two prompts, or a model length under the longer request."""
    fits = (num_blocks > sum(_blocks_needed(block_size))
            and runner.input_batch.max_num_reqs >= len(_REQ_IDS)
            and runner.max_num_batched_tokens >= sum(_PROMPT_LENS)
            and runner.max_model_len >= max(_PROMPT_LENS) + _NUM_DECODES)
    if not fits:
        return
    start = time.perf_counter()
    for scheduler_output in _steps(block_size):
        runner.execute_model(scheduler_output)
    logger.info("event=worker_warmed_up seconds=%.1f", time.perf_counter() - start)
