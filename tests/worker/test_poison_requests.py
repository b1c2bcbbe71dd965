"""One request the worker cannot serve fails alone; the worker and the batch go on.

The tiny random Llama, driven by the real Scheduler: poisoned requests
(refused by a logits processor, one whose callable raises or writes NaN, a
prompt outside the vocabulary) run among ordinary ones, whose tokens must
equal a run without them. A step that fails as a whole fails its own
requests and the next steps run normally.
"""

from __future__ import annotations

import grpc
import pytest

from services.common.limits import SchedulingLimits
from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from services.worker.worker import MAX_CONSECUTIVE_FAILED_STEPS
from tests.worker.helpers import (
    VOCAB_SIZE,
    greedy_request,
    make_scheduler,
    make_worker,
    random_prompts,
    run_engine,
)

PROCS = "tests.worker.sample.kvmesh_test_logitsprocs"
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
INTERNAL = grpc.StatusCode.INTERNAL.value[0]


def ordinary_arrivals() -> list:
    prompts = random_prompts([5, 30, 12], seed=3)
    return [(step, greedy_request(f"r{i}", p, 12))
            for i, (step, p) in enumerate(zip([0, 1, 4], prompts))]


def test_poisoned_requests_fail_alone(tiny_model_dir):
    worker = make_worker(tiny_model_dir, logits_processors=[f"{PROCS}:PoisonAdapter"])
    expected = run_engine(make_scheduler(worker), worker, ordinary_arrivals()).token_ids

    poisoned = [(2, greedy_request(f"p-{poison}", [7] * 20, 8, extra_args={"poison": poison}))
                for poison in ("refuse", "raise", "nan")]
    poisoned.append((3, greedy_request("p-oov", [5, VOCAB_SIZE + 3], 8)))
    scheduler = make_scheduler(worker)
    result = run_engine(scheduler, worker, ordinary_arrivals() + poisoned)

    assert {k: v for k, v in result.token_ids.items() if k.startswith("r")} == expected
    assert result.errors == {
        "p-refuse": (INVALID_ARGUMENT, "logits processor PoisonAdapter refused the request: "
                                       "extra_args['poison'] is 'refuse'"),
        "p-raise": (INTERNAL, "logits processor PoisonAdapter failed: "
                              "RuntimeError('poisoned callable')"),
        "p-nan": (INTERNAL, "the logits for this request are not finite (NaN, +inf, or "
                            "every token masked)"),
        "p-oov": (INVALID_ARGUMENT, f"prompt_token_ids holds token id {VOCAB_SIZE + 3}; "
                                    f"allowed range is [0, {VOCAB_SIZE})"),
    }
    assert all(not result.token_ids[f"p-{p}"] for p in ("refuse", "raise", "nan", "oov"))
    assert worker.model_runner.requests == {} and worker.model_runner.input_batch.num_reqs == 0
    manager = scheduler.kv_cache_manager
    assert manager.num_free_blocks == manager.block_pool.num_blocks - 1


def test_a_failed_step_fails_its_requests_and_the_worker_goes_on(tiny_model_dir):
    worker = make_worker(tiny_model_dir, logits_processors=[f"{PROCS}:ExplodingProcessor"])
    later = [(step, request) for step, request in ordinary_arrivals() if step > 3]
    expected = run_engine(make_scheduler(worker), worker, later).token_ids

    exploding = greedy_request("explode", [9] * 6, 8, extra_args={"explode": True})
    scheduler = make_scheduler(worker)
    result = run_engine(scheduler, worker, ordinary_arrivals()[:2] + [(2, exploding)] + later)

    message = "the worker failed to run the step: RuntimeError('exploding processor')"
    assert result.errors == {"r0": (INTERNAL, message), "r1": (INTERNAL, message),
                             "explode": (INTERNAL, message)}
    assert {k: result.token_ids[k] for k in expected} == expected
    assert worker.num_consecutive_failed_steps == 0


def test_request_unknown_to_the_worker_fails_alone(tiny_model_dir):
    """With asynchronous scheduling a step can name a request the worker failed
    a step earlier; it fails again, alone, and the worker goes on."""
    worker = make_worker(tiny_model_dir)
    ghost = SchedulerOutput(
        scheduled_cached_reqs=CachedRequestData(["ghost"], [False], [[]], [0]),
        num_scheduled_tokens={"ghost": 1}, total_num_scheduled_tokens=1, step_id=1)
    output = worker.execute_model(ghost)
    assert (output.req_ids, list(output.failed)) == ([], ["ghost"])
    assert output.failed["ghost"].status_code == INTERNAL
    assert worker.num_consecutive_failed_steps == 0


def test_consecutive_failed_steps_end_the_worker(tiny_model_dir):
    worker = make_worker(tiny_model_dir,
                         limits=SchedulingLimits(max_num_seqs=4, max_num_batched_tokens=32))

    def oversized_step(step_id: int) -> SchedulerOutput:
        # More tokens than the worker's buffers hold: the step cannot run.
        req_id = f"big-{step_id}"
        new = NewRequestData(req_id, list(range(1, 41)), SamplingParams(max_tokens=1),
                             block_ids=[1, 2, 3], num_computed_tokens=0)
        return SchedulerOutput(scheduled_new_reqs=[new], num_scheduled_tokens={req_id: 40},
                               total_num_scheduled_tokens=40, step_id=step_id)

    for step_id in range(1, MAX_CONSECUTIVE_FAILED_STEPS):
        output = worker.execute_model(oversized_step(step_id))
        assert (output.req_ids, list(output.failed)) == ([], [f"big-{step_id}"])
        assert output.failed[f"big-{step_id}"].status_code == INTERNAL
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        worker.execute_model(oversized_step(MAX_CONSECUTIVE_FAILED_STEPS))
