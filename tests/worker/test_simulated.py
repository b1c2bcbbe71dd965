"""The simulated worker: deterministic tokens through the real batch, a modelled wait."""

from __future__ import annotations

import numpy as np
import pytest

from services.common.limits import SchedulingLimits
from services.worker.config import LatencyModel, WorkerConfig
from services.worker.simulated import simulated_token_ids
from tests.worker.helpers import (
    VOCAB_SIZE,
    greedy_request,
    make_scheduler,
    make_worker,
    random_prompts,
    run_engine,
)


def expected_tokens(prompt: list[int], max_tokens: int, eos_token_ids=(2,)) -> list[int]:
    """What the simulated worker must say: one token at a time from the formula."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        next_token = simulated_token_ids(np.array([tokens[-1]]), np.array([len(tokens) - 1]),
                                         VOCAB_SIZE, eos_token_ids)
        tokens.append(int(next_token[0]))
    return tokens[len(prompt):]


def test_token_ids_are_a_function_of_the_last_token_and_position_and_never_eos():
    last = np.arange(5000) % VOCAB_SIZE
    positions = np.arange(5000)
    token_ids = simulated_token_ids(last, positions, VOCAB_SIZE, [7, 8])
    assert token_ids.min() >= 0 and token_ids.max() < VOCAB_SIZE
    assert not np.isin(token_ids, [7, 8]).any()
    assert (token_ids == simulated_token_ids(last, positions, VOCAB_SIZE, [7, 8])).all()
    assert len(set(token_ids.tolist())) > VOCAB_SIZE // 2


def test_latency_model():
    latency = LatencyModel(base_ms=2.0, us_per_token=10.0, us_per_context_token=0.5)
    assert latency.step_seconds(100, 1000) == pytest.approx(0.002 + 0.001 + 0.0005)
    with pytest.raises(ValueError, match=r"us_per_token is -1.0, allowed range is \[0, 60000\]"):
        LatencyModel(us_per_token=-1.0)
    with pytest.raises(ValueError, match="simulate runs on the CPU"):
        WorkerConfig(simulate=LatencyModel(), device="cuda")


def test_simulated_worker_through_the_real_batch(tiny_model_dir):
    """Chunked prefill, preemption (a pool too small for all) and late arrivals."""
    worker = make_worker(tiny_model_dir, simulate=LatencyModel(base_ms=0.0), num_kv_blocks=8,
                         limits=SchedulingLimits(max_num_batched_tokens=24))
    assert worker.model is None and worker.model_runner.kv_caches == []
    prompts = random_prompts([5, 40, 17, 33], seed=5)
    max_tokens = [30, 12, 25, 20]
    arrivals = [(step, greedy_request(f"r{i}", p, n))
                for i, (step, p, n) in enumerate(zip([0, 0, 1, 2], prompts, max_tokens))]
    scheduler = make_scheduler(worker)
    result = run_engine(scheduler, worker, arrivals)
    assert scheduler.make_stats().num_preemptions > 0
    assert result.num_steps_with_discarded_sample > 0  # a prompt was cut into chunks
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        assert result.token_ids[f"r{i}"] == expected_tokens(prompt, n)
