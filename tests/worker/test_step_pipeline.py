"""Step N+1 prepared while step N is on the device: same tokens, same failures.

The real model cannot be slower than its launch on the CPU, so the overlap
on it is driven by hand in the pipeline's order (prepare N+1, finish N,
launch N+1); the StepPipeline itself is run with the simulated worker, whose
steps end on a deadline like a GPU's.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from concurrent.futures import Future

import pytest

from kvmesh.offline.engine_core import EngineCore
from services.common.limits import SchedulingLimits
from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import NewRequestData, SchedulerOutput
from services.scheduler.scheduler import Scheduler
from services.worker.config import LatencyModel, WorkerConfig
from services.worker.step_events import DeadlineEvent
from services.worker.step_pipeline import StepPipeline, next_submitted
from services.worker.worker import MAX_CONSECUTIVE_FAILED_STEPS, Worker, WorkerStep
from tests.cuda import CUDA_MARKS
from tests.worker.helpers import (
    RunResult,
    greedy_request,
    make_scheduler,
    make_worker,
    random_prompts,
    run_engine,
)
from tests.worker.test_poison_requests import PROCS, ordinary_arrivals


def run_overlapped(scheduler: Scheduler, worker: Worker, arrivals: list) -> tuple[RunResult, int]:
    """The engine loop with each step prepared before the previous one is finished.

    Returns the result and how many input ids waited for a sample of the
    step before (filled in at the launch).
    """
    result = RunResult()
    pending = sorted(arrivals, key=lambda a: a[0])
    in_flight: WorkerStep | None = None
    num_deferred = step = 0
    while pending or scheduler.has_requests() or in_flight is not None:
        while pending and pending[0][0] <= step:
            request = pending.pop(0)[1]
            result.token_ids[request.request_id] = []
            scheduler.add_request(request)
        next_step = None
        if scheduler.has_requests():
            next_step = worker.prepare_step(scheduler.schedule())
            if next_step.prepared is not None and next_step.prepared.deferred_rows is not None:
                num_deferred += len(next_step.prepared.deferred_rows)
        if in_flight is not None:
            output = worker.finish_step(in_flight)
            outputs = scheduler.update_from_output(in_flight.scheduler_output, output)
            for client_outputs in outputs.values():
                for out in client_outputs.outputs:
                    result.token_ids[out.request_id].extend(out.new_token_ids)
                    if out.status_code and out.request_id not in result.errors:
                        result.errors[out.request_id] = (out.status_code, out.finish_message)
        in_flight = worker.launch_step(next_step) if next_step is not None else None
        step += 1
        assert step < 500, "engine loop did not finish"
    return result, num_deferred


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=CUDA_MARKS),
])
def test_overlapped_steps_give_the_same_tokens_and_failures(tiny_model_dir, device):
    """Mixed prefill and decode, chunked prompts, preemption and poisoned requests
    (one fails while the next step, already prepared, holds its row). On CUDA
    the step really is still running when the next one is prepared."""
    worker = make_worker(tiny_model_dir, num_kv_blocks=10, device=device,
                         logits_processors=[f"{PROCS}:PoisonAdapter"],
                         limits=SchedulingLimits(max_num_batched_tokens=32))
    poisoned = [(2, greedy_request(f"p-{poison}", [7] * 20, 8, extra_args={"poison": poison}))
                for poison in ("raise", "nan")]
    prompts = random_prompts([40, 9], seed=11)
    arrivals = (ordinary_arrivals() + poisoned
                + [(3, greedy_request(f"late{i}", p, 20)) for i, p in enumerate(prompts)])
    expected = run_engine(make_scheduler(worker), worker, arrivals)

    scheduler = make_scheduler(worker, async_scheduling=True)
    result, num_deferred = run_overlapped(scheduler, worker, arrivals)

    assert num_deferred > 0  # the overlap happened: samples were filled in at launch
    assert result.token_ids == expected.token_ids
    assert result.errors == expected.errors and set(result.errors) == {"p-raise", "p-nan"}
    runner = worker.model_runner
    assert runner.requests == {} and runner.input_batch.num_reqs == 0 and not runner._doomed
    manager = scheduler.kv_cache_manager
    assert manager.num_free_blocks == manager.block_pool.num_blocks - 1


class _OrderLog(Worker):
    """A worker noting the order of its steps' parts."""

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.log: list[tuple[str, int]] = []

    def prepare_step(self, scheduler_output: SchedulerOutput) -> WorkerStep:
        self.log.append(("prepare", scheduler_output.step_id))
        return super().prepare_step(scheduler_output)

    def finish_step(self, step: WorkerStep):
        self.log.append(("finish", step.scheduler_output.step_id))
        return super().finish_step(step)


def run_offline(tiny_model_dir, max_steps_in_flight: int) -> tuple[dict[str, list[int]], list]:
    worker = _OrderLog(WorkerConfig(model=str(tiny_model_dir), max_model_len=256,
                                    simulate=LatencyModel(base_ms=50.0)))
    worker.load_model()
    worker.initialize_kv_cache()
    core = EngineCore(make_scheduler(worker, async_scheduling=max_steps_in_flight > 1), worker,
                      max_steps_in_flight)
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(random_prompts([12, 30, 5], seed=2)):
        core.add_request(greedy_request(f"r{i}", prompt, 10))
        tokens[f"r{i}"] = []
    while core.has_requests():
        for out in core.step().outputs:
            tokens[out.request_id].extend(out.new_token_ids)
    return tokens, worker.log


def test_pipeline_prepares_the_next_step_while_the_device_runs(tiny_model_dir):
    tokens, log = run_offline(tiny_model_dir, max_steps_in_flight=2)
    sync_tokens, sync_log = run_offline(tiny_model_dir, max_steps_in_flight=1)
    assert tokens == sync_tokens and all(len(t) == 10 for t in tokens.values())
    # Synchronously each step is finished before the next is prepared; in the
    # pipeline, the next step is prepared while the 50 ms step runs.
    overlapped = [i for i in range(1, len(log))
                  if log[i - 1][0] == "prepare" and log[i] == ("finish", log[i - 1][1] - 1)]
    assert len(overlapped) >= 5, log
    assert not any(sync_log[i][0] == sync_log[i + 1][0] for i in range(len(sync_log) - 1))


def test_a_worker_that_gives_up_fails_every_later_step(tiny_model_dir):
    worker = make_worker(tiny_model_dir,
                         limits=SchedulingLimits(max_num_seqs=4, max_num_batched_tokens=32))
    done_steps: list[int] = []
    pipeline = StepPipeline(worker, lambda so, seconds: done_steps.append(so.step_id))

    def oversized_step(step_id: int) -> SchedulerOutput:
        new = NewRequestData(f"big-{step_id}", list(range(1, 41)), SamplingParams(max_tokens=1),
                             block_ids=[1, 2, 3], num_computed_tokens=0)
        return SchedulerOutput(scheduled_new_reqs=[new], num_scheduled_tokens={new.req_id: 40},
                               total_num_scheduled_tokens=40, step_id=step_id)

    futures: list[Future] = [pipeline.submit(oversized_step(i))
                             for i in range(1, MAX_CONSECUTIVE_FAILED_STEPS + 2)]
    pipeline.close()
    for future in futures[: MAX_CONSECUTIVE_FAILED_STEPS - 1]:
        assert list(future.result().failed) == [f"big-{future.result().step_id}"]
    for future in futures[MAX_CONSECUTIVE_FAILED_STEPS - 1 :]:
        with pytest.raises(ValueError, match="max_num_batched_tokens"):
            future.result()
    assert done_steps == list(range(1, MAX_CONSECUTIVE_FAILED_STEPS))


def test_a_step_ending_microseconds_after_the_wait_begins_ends_the_wait():
    """A simulated step ends microseconds after its launch. Waiting for the next
    submission must end with it: with synchronous scheduling nothing else is
    submitted until that step is answered. (CPython 3.11's SimpleQueue could
    miss such a deadline and wait for the next put: about 1 wait in 1,000.)"""
    submitted: queue.Queue[object] = queue.Queue()
    rescue = object()  # what the watchdog submits to a wait that missed its step's end
    num_waits = 0
    finished = threading.Event()

    def watchdog() -> None:
        seen = -1
        while not finished.wait(2.0):
            if num_waits == seen:
                submitted.put(rescue)
            seen = num_waits

    threading.Thread(target=watchdog, daemon=True).start()
    try:
        for num_waits in range(20_000):
            submitted.put(None)
            submitted.get()  # the state between two steps: just emptied
            done = DeadlineEvent(time.perf_counter() + random.uniform(0.0, 2e-6))
            assert next_submitted(submitted, done) is not rescue and done.query()
    finally:
        finished.set()
