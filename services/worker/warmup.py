"""Warm-up steps that compile the worker's graphs before it registers.

torch.compile builds on first use. A worker that compiled during its first
real step would stall that request for as long as inductor takes (tens of
seconds cold), so, as vLLM's ``compile_or_warm_up_model``, the worker runs
made-up steps first, one for each compiled variant a real step can need:

* a prefill at least ``_MIN_LONG_PROMPT`` tokens long, and past where quantized
  layers dequantize (``quantized_choice.wide_rows``) where the token budget
  allows: the pieces for wide batches, the prefill attention;
* two short prefills, beside one decode and then two: the pieces for narrow
  batches, the decode attention of mixed steps (one row, then several);
* a decode of three requests, then of one: the decode step's graph for dynamic
  batches and torch's batch-of-one specialization;
* where quantized layers dequantize from some width and the batch can hold
  that many, as many one-token prompts: a step shaped as a decode that wide.

They write garbage K/V into blocks from 1 on, which no request owns yet;
block 0, the null block, is never touched.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from services.worker.layers.quantized_choice import wide_rows

if TYPE_CHECKING:
    from services.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)
_LONG, _SHORT_A, _SHORT_B = "warmup-long", "warmup-short-a", "warmup-short-b"
_MIN_LONG_PROMPT = 34
_NUM_DECODES = 4  # most tokens a request gets after its prompt


def _prompt_lens(long_len: int) -> dict[str, int]:
    return {_LONG: long_len, _SHORT_A: 3, _SHORT_B: 3}


def _blocks_needed(block_size: int, prompt_lens: dict[str, int]) -> dict[str, int]:
    return {r: -(-(n + _NUM_DECODES) // block_size) for r, n in prompt_lens.items()}


def _steps(block_size: int, prompt_lens: dict[str, int]) -> list[SchedulerOutput]:
    """The warm-up's steps: each one's new prompts and decodes, then every request's end."""
    params = SamplingParams(temperature=0.0, max_tokens=_NUM_DECODES + 1, ignore_eos=True)
    new, first_block = {}, 1  # block 0 is the null block
    for req_id, num_blocks in _blocks_needed(block_size, prompt_lens).items():
        prompt = list(range(1, prompt_lens[req_id] + 1))
        block_ids = list(range(first_block, first_block + num_blocks))
        new[req_id] = NewRequestData(req_id, prompt, params, block_ids, 0)
        first_block += num_blocks
    # (new prompts, decodes) per step; a request missing from a step's decodes ends there.
    schedule = [([_LONG], []), ([_SHORT_A], [_LONG]), ([_SHORT_B], [_LONG, _SHORT_A]),
                ([], [_LONG, _SHORT_A, _SHORT_B]), ([], [_LONG])]
    num_computed: dict[str, int] = {}
    steps = []
    for new_ids, decode_ids in schedule:
        scheduled = {r: prompt_lens[r] for r in new_ids} | dict.fromkeys(decode_ids, 1)
        cached = CachedRequestData(decode_ids, [False] * len(decode_ids),
                                   [[] for _ in decode_ids], [num_computed[r] for r in decode_ids])
        finished = set(num_computed) - set(decode_ids)
        steps.append(SchedulerOutput(scheduled_new_reqs=[new[r] for r in new_ids],
                                     scheduled_cached_reqs=cached, num_scheduled_tokens=scheduled,
                                     total_num_scheduled_tokens=sum(scheduled.values()),
                                     finished_req_ids=finished))
        num_computed = {r: num_computed.get(r, 0) + n for r, n in scheduled.items()}
    steps.append(SchedulerOutput(finished_req_ids=set(num_computed)))
    return steps


def _wide_decode_steps(first_block: int, num_reqs: int) -> list[SchedulerOutput]:
    """``num_reqs`` one-token prompts in one step (one block each), then their end."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    req_ids = [f"warmup-wide-{i}" for i in range(num_reqs)]
    new = [NewRequestData(req_id, [1], params, [first_block + i], 0)
           for i, req_id in enumerate(req_ids)]
    step = SchedulerOutput(scheduled_new_reqs=new, num_scheduled_tokens=dict.fromkeys(req_ids, 1),
                           total_num_scheduled_tokens=len(req_ids))
    return [step, SchedulerOutput(finished_req_ids=set(req_ids))]


def warm_up_model(runner: ModelRunner, block_size: int, num_blocks: int) -> None:
    """Runs the warm-up steps on ``runner``; the runner ends with no requests. Does
    nothing where they do not fit: too few KV blocks or batch rows, a token budget
    under the longest prompt, or a model length under the longest request."""
    wide = wide_rows(runner.model)
    long_len = _MIN_LONG_PROMPT
    if (wide is not None and wide + 1 <= runner.max_num_batched_tokens
            and wide + 1 + _NUM_DECODES <= runner.max_model_len):
        long_len = max(long_len, wide + 1)
    prompt_lens = _prompt_lens(long_len)
    blocks_needed = sum(_blocks_needed(block_size, prompt_lens).values())
    fits = (num_blocks > blocks_needed
            and runner.input_batch.max_num_reqs >= len(prompt_lens)
            and runner.max_num_batched_tokens >= long_len
            and runner.max_model_len >= long_len + _NUM_DECODES)
    if not fits:
        return
    steps = _steps(block_size, prompt_lens)
    first_free = 1 + blocks_needed
    if (wide is not None and runner.input_batch.max_num_reqs >= wide
            and runner.max_num_batched_tokens >= wide and num_blocks >= first_free + wide):
        steps += _wide_decode_steps(first_free, wide)
    start = time.perf_counter()
    for scheduler_output in steps:
        runner.execute_model(scheduler_output)
    logger.info("event=worker_warmed_up seconds=%.1f", time.perf_counter() - start)
