"""Runs a worker's steps in order on a thread of its own, preparing each step's
inputs while the previous step is still on the device.

With asynchronous scheduling the next step arrives while this one computes.
The pipeline then does the host's share of it (batch update, input buffers,
copies: ``Worker.prepare_step``) during the device time, collects this
step's output (its one host sync), completes its future, and launches the
next one; only the collection and the launch sit between two steps on the
device. The input ids that need this step's samples are filled in at the
launch. A step whose device work ends before the next one arrives is
collected at once, so synchronous scheduling, and a CPU worker (whose
forward pass is done when its launch returns), never wait on the pipeline.
A worker whose steps depend on the previous step's outcome (speculative
decoding: positions and drafts follow what it accepted) has each step
collected before the next is prepared.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError

from services.common.model_runner_output import ModelRunnerOutput
from services.common.scheduler_output import SchedulerOutput
from services.worker.step_events import StepEvent
from services.worker.worker import Worker, WorkerStep

# Queue markers: the in-flight step is done on the device; close() was called.
_DEVICE_DONE = object()
_CLOSE = object()

OnStepDone = Callable[[SchedulerOutput, float], None]


class StepPipeline:
    """``submit`` steps in order; each output comes back through its future, in order.

    ``on_step_done(scheduler_output, seconds)`` is called on the pipeline's
    thread for each step executed (from its launch to its output). An error
    the worker raises (a device failure, too many failed steps in a row) is
    set on that step's future and on every later one. The worker must not be
    used elsewhere until ``close()``.
    """

    def __init__(self, worker: Worker, on_step_done: OnStepDone | None = None) -> None:
        self._worker = worker
        self._on_step_done = on_step_done
        # Not a SimpleQueue: on CPython 3.11 its get(timeout=t) can wait until the
        # next put when t is a few microseconds (a simulated step's end), and
        # with synchronous scheduling no put comes until this step is answered.
        self._queue: queue.Queue[object] = queue.Queue()
        self._fatal: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvmesh-step-pipeline", daemon=True)
        self._thread.start()

    def submit(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Queues a step; its future holds the output once the step is done."""
        future: Future[ModelRunnerOutput] = Future()
        self._queue.put((scheduler_output, future))
        return future

    def close(self) -> None:
        """Finishes the steps submitted so far, then stops the thread.

        Called on the pipeline's own thread (a finalizer run by a garbage
        collection there), it only asks the thread to stop.
        """
        self._queue.put(_CLOSE)
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _run(self) -> None:
        in_flight: tuple[WorkerStep, Future[ModelRunnerOutput], float] | None = None
        while True:
            item = next_submitted(self._queue, in_flight[0].done if in_flight is not None else None)
            if item is _DEVICE_DONE or item is _CLOSE:
                if in_flight is not None:
                    self._complete(*in_flight)
                    in_flight = None
                if item is _CLOSE:
                    return
                continue
            scheduler_output, future = item  # type: ignore[misc]
            if self._fatal is not None:
                _fail(future, self._fatal)
                continue
            if in_flight is not None and not self._worker.overlaps_steps:
                self._complete(*in_flight)
                in_flight = None
                if self._fatal is not None:
                    _fail(future, self._fatal)
                    continue
            step = self._worker.prepare_step(scheduler_output)
            if in_flight is not None:
                self._complete(*in_flight)
                in_flight = None
                if self._fatal is not None:
                    _fail(future, self._fatal)
                    continue
            in_flight = (self._worker.launch_step(step), future, time.perf_counter())

    def _complete(self, step: WorkerStep, future: Future[ModelRunnerOutput], start: float) -> None:
        try:
            output = self._worker.finish_step(step)
        except BaseException as e:  # the worker gives up: so does every later step
            self._fatal = e
            _fail(future, e)
            return
        if self._on_step_done is not None:
            self._on_step_done(step.scheduler_output, time.perf_counter() - start)
        # A future its caller cancelled still had its step run, in order.
        with contextlib.suppress(InvalidStateError):
            future.set_result(output)


def next_submitted(submitted: queue.Queue[object], in_flight: StepEvent | None) -> object:
    """The next submitted item; with a step in flight, _DEVICE_DONE instead if that
    step's device work ends first."""
    if in_flight is None:
        return submitted.get()
    while not in_flight.query():
        try:
            return submitted.get(timeout=in_flight.poll_interval_s())
        except queue.Empty:
            pass
    return _DEVICE_DONE


def _fail(future: Future[ModelRunnerOutput], error: BaseException) -> None:
    with contextlib.suppress(InvalidStateError):
        future.set_exception(error)
