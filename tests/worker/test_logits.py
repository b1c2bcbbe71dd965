"""Logits: only rows whose sample is kept reach the LM head, into buffers allocated once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.worker.helpers import (
    greedy_request,
    make_scheduler,
    make_worker,
    random_prompts,
    run_engine,
)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_only_sampled_rows_reach_the_lm_head(tiny_model_dir: Path, dtype: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A long prompt is prefilled in chunks beside decodes: its unfinished chunks'
    rows never reach the head, and the results equal a run without chunking."""
    worker = make_worker(tiny_model_dir, dtype=dtype)
    runner = worker.model_runner
    head_rows: list[int] = []
    sampled_logits: list[torch.Tensor] = []
    compute_logits, sampler = runner.model.compute_logits, runner.sampler.forward

    def counting_compute_logits(hidden_states, out=None):
        head_rows.append(hidden_states.shape[0])
        return compute_logits(hidden_states, out=out)

    def recording_sampler(logits, metadata):
        sampled_logits.append(logits)
        return sampler(logits, metadata)

    monkeypatch.setattr(runner.model, "compute_logits", counting_compute_logits)
    monkeypatch.setattr(runner.sampler, "forward", recording_sampler)
    prompts = random_prompts([5, 70, 6], seed=11)
    arrivals = [(0, greedy_request("a", prompts[0], 8)), (2, greedy_request("long", prompts[1], 4)),
                (2, greedy_request("c", prompts[2], 6))]
    chunked = run_engine(make_scheduler(worker, long_prefill_token_threshold=16), worker, arrivals)
    scheduled = chunked.scheduled_per_step
    assert any(0 < n < 70 for step in scheduled for r, n in step.items() if r == "long")
    # One head row per request that finished its prompt in the step, no more (a
    # step that schedules nothing runs no model).
    expected = [sum(1 for r in step if r != "long" or done)
                for step, done in zip(scheduled, _long_prompt_done(scheduled, 70)) if step]
    assert head_rows == expected
    # The sampler always reads the runner's float32 buffer: nothing vocabulary-sized
    # is allocated per step.
    assert all(t.dtype == torch.float32 and t.data_ptr() == runner.logits.data_ptr()
               for t in sampled_logits)
    if dtype == "float32":  # bfloat16 may round a near tie apart in another batch shape
        reference = make_worker(tiny_model_dir, dtype=dtype)
        unchunked = run_engine(make_scheduler(reference), reference, arrivals)
        assert chunked.token_ids == unchunked.token_ids


def _long_prompt_done(scheduled: list[dict[str, int]], prompt_len: int) -> list[bool]:
    """Per step: whether request "long" (if scheduled) finishes its prompt in it."""
    done, computed = [], 0
    for step in scheduled:
        computed += step.get("long", 0)
        done.append(computed >= prompt_len)
    return done
