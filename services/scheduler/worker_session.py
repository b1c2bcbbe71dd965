"""One registered worker: its own Scheduler (block pool) and the loop that drives it."""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvmesh.v1 import scheduler_pb2 as spb
from services.common.convert import drain_message, registered_message, step_message
from services.common.engine import EngineCoreOutputs
from services.common.model_runner_output import ModelRunnerOutput
from services.common.scheduler_output import SchedulerOutput
from services.common.stats import SchedulerStats
from services.scheduler.block_map import make_block_map
from services.scheduler.kv_store import KVStore
from services.scheduler.metrics import WorkerMetrics
from services.scheduler.request import Request, RequestStatus
from services.scheduler.scheduler import Scheduler
from services.scheduler.token_rate import TokenRateHistory
from services.scheduler.worker_checks import WorkerProtocolError, check_runner_output


class WorkerStepTimeout(RuntimeError):
    """The worker did not answer a step in time: it is frozen or gone."""


# The exit code of the fault-injection hook (SchedulerServiceConfig.fault_exit_after_step).
FAULT_EXIT_CODE = 70

# How often an idle session checks whether its store needs the whole state again.
_IDLE_STORE_CHECK_S = 0.5

# Called with each step's outputs, keyed by client index.
OutputsCallback = Callable[["WorkerSession", dict[int, EngineCoreOutputs]], None]


@dataclass(slots=True, eq=False)
class StepInFlight:
    """A step sent to the worker: what was scheduled and its output, once it arrives."""

    scheduler_output: SchedulerOutput
    output: asyncio.Future[ModelRunnerOutput]
    sent_time: float


class WorkerSession:
    """Drives one worker: wait for work -> schedule -> step -> update -> route.

    One asyncio task per session. Up to ``max_steps_in_flight`` steps are sent
    before the oldest one's output arrives (2: asynchronous scheduling, the
    next step is scheduled and on the wire while the worker computes; 1:
    synchronous). The worker answers steps in order, so a block freed while a
    step in flight still writes it (an abort, a preemption) is only written
    by its next holder in a later step. When there is nothing to do the loop
    sleeps on an event that ``add_request`` / ``abort_requests`` set (no
    polling).

    Messages for the worker go through ``outbox`` (the WorkerStream handler
    sends them); None there ends the stream. Each step is recorded in
    ``metrics``; ``scheduler`` must have been built with ``log_stats``.
    """

    def __init__(self, worker_id: str, engine_index: int, scheduler: Scheduler,
                 store: KVStore, on_outputs: OutputsCallback, metrics: WorkerMetrics,
                 vocab_size: int, step_timeout_s: float | None = None,
                 fault_exit_after_step: float = 0.0, max_steps_in_flight: int = 1) -> None:
        self.worker_id = worker_id
        self.engine_index = engine_index
        self.vocab_size = vocab_size
        self._step_timeout_s = step_timeout_s
        self._fault_exit_after_step = fault_exit_after_step
        self.scheduler = scheduler
        self.store = store
        self.metrics = metrics
        self.num_generation_tokens = 0
        self.generation_history = TokenRateHistory()
        self.outbox: asyncio.Queue[spb.SchedulerMessage | None] = asyncio.Queue()
        self.outbox.put_nowait(registered_message(engine_index))
        self._on_outputs = on_outputs
        self._wakeup = asyncio.Event()
        self.max_steps_in_flight = max_steps_in_flight
        self.in_flight: deque[StepInFlight] = deque()
        self._last_output_time = 0.0
        self._task: asyncio.Task[None] | None = None
        self._draining = False
        self.leaving = False  # granted a move to another cell (see leave())
        self.closed = False

    # ------------------------------------------------------------ lifecycle

    def start(self, on_failure: Callable[[WorkerSession, BaseException], None]) -> None:
        """Starts the step loop; ``on_failure`` runs if it dies of an error."""
        self._task = asyncio.create_task(self._run(), name=f"worker-session-{self.worker_id}")

        def done(task: asyncio.Task[None]) -> None:
            if not task.cancelled() and task.exception() is not None:
                on_failure(self, task.exception())

        self._task.add_done_callback(done)

    def close(self) -> None:
        """Stops the loop and ends the worker's stream. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self._task is not None:
            self._task.cancel()
        self.outbox.put_nowait(None)

    def drain(self) -> None:
        """Stops stepping; the worker is told to leave once it answered the step in flight."""
        self._draining = True
        self._wakeup.set()

    def leave(self) -> None:
        """Lets the worker move to another cell: its requests run to the end (the
        coordinator places nothing new here), then it is drained."""
        self.leaving = True
        self._wakeup.set()

    def stay(self) -> bool:
        """Takes back ``leave()`` unless the drain has begun; whether it did."""
        if self._draining:
            return False
        self.leaving = False
        return True

    # ------------------------------------------------------------ requests

    def add_request(self, request: Request) -> None:
        """Queues a request built with this worker's block hasher.

        Raises what ``Scheduler.add_request`` raises (WaitingQueueFullError,
        ValueError), in which case nothing changed.
        """
        self.scheduler.add_request(request)
        self._wakeup.set()

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Frees the requests' blocks; the worker drops them with the next step."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        self._wakeup.set()

    def make_stats(self, include_block_map: bool = False) -> SchedulerStats:
        """The scheduler's stats plus this session's generation history (and the
        block map: a scan of the whole pool, only when asked for)."""
        stats = self.scheduler.make_stats()
        stats.num_generation_tokens = self.num_generation_tokens
        stats.generation_tokens_per_s = self.generation_history.rates(time.monotonic())
        stats.history_interval_s = self.generation_history.interval_s
        if include_block_map:
            block_map = make_block_map(self.scheduler.kv_cache_manager.block_pool)
            stats.block_map = block_map.cells
            stats.blocks_per_cell = block_map.blocks_per_cell
            stats.num_cached_free_blocks = block_map.num_cached_free_blocks
        return stats

    def unfinished_requests(self) -> list[Request]:
        """Requests still waiting or running here, in (priority, arrival) order."""
        return sorted(self.scheduler.requests.values())

    def on_runner_output(self, output: ModelRunnerOutput) -> None:
        """Hands the worker's output to the loop once it is checked against the
        oldest unanswered step (``worker_checks.check_runner_output``);
        WorkerProtocolError if not."""
        step = next((s for s in self.in_flight if not s.output.done()), None)
        if step is None:
            raise WorkerProtocolError(f"worker {self.worker_id} answered step "
                                      f"{output.step_id}, but no step is in flight")
        try:
            check_runner_output(output, step.scheduler_output, self.vocab_size)
        except WorkerProtocolError as e:
            raise WorkerProtocolError(f"worker {self.worker_id}: {e}") from None
        if self._fault_exit_after_step and random.random() < self._fault_exit_after_step:
            os._exit(FAULT_EXIT_CODE)  # fault injection: die as SIGKILL would, mid-step
        step.output.set_result(output)

    # ------------------------------------------------------------ loop

    async def _run(self) -> None:
        scheduler = self.scheduler
        in_flight = self.in_flight
        while not (self._draining and not in_flight):
            # Cleared before looking at the queues: whatever arrives from here
            # on sets it again, so no wakeup is lost.
            self._wakeup.clear()
            if self.leaving and not in_flight and not scheduler.has_requests():
                self._draining = True  # a granted move: nothing of its own is left
                continue
            if (not self._draining and len(in_flight) < self.max_steps_in_flight
                    and scheduler.has_requests()):
                scheduler_output = scheduler.schedule()
                if scheduler_output.total_num_scheduled_tokens or scheduler_output.finished_req_ids:
                    self._send(scheduler_output)
                    continue  # fill the pipeline
                if not in_flight:
                    # Nothing to compute: flush outputs of requests that finished
                    # outside a step (IGNORED) without a round trip, then sleep
                    # until a new request or an abort changes that.
                    self._apply(scheduler_output, ModelRunnerOutput(step_id=scheduler_output.step_id))
                    if self.closed:
                        return
                    await self._idle()
                    continue
                # Else only the outputs in flight can make room: wait for them.
            if in_flight:
                step = in_flight[0]
                runner_output = await self._wait(step)
                in_flight.popleft()
                self._apply(step.scheduler_output, runner_output, step.sent_time)
                if self.closed:
                    return  # its requests were re-placed: what it produced is not theirs
            else:
                await self._idle()
        self.outbox.put_nowait(drain_message(leave_granted=self.leaving))

    def _send(self, scheduler_output: SchedulerOutput) -> None:
        # Tells the worker which of the blocks it wrote the mirror now covers.
        scheduler_output.durable_step_id = self.store.durable_step_id
        future: asyncio.Future[ModelRunnerOutput] = asyncio.get_running_loop().create_future()
        self.in_flight.append(StepInFlight(scheduler_output, future, time.monotonic()))
        self.outbox.put_nowait(step_message(scheduler_output))

    async def _wait(self, step: StepInFlight) -> ModelRunnerOutput:
        # Not wait_for: it can swallow the cancellation close() sends when the
        # answer arrives at the same moment, and a closed session must not go on.
        done, _ = await asyncio.wait((step.output,), timeout=self._step_timeout_s)
        if not done:
            raise WorkerStepTimeout(f"worker {self.worker_id} did not answer step "
                                    f"{step.scheduler_output.step_id} within "
                                    f"{self._step_timeout_s} s")
        return step.output.result()

    def _apply(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput,
               sent_time: float | None = None) -> None:
        """Updates the scheduler with a step's output and routes what it produced.
        ``sent_time`` None: the step never went to the worker."""
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if self.closed:
            return
        if sent_time is not None:
            now = time.monotonic()
            # The worker's time on this step: from when it could start it.
            step_time_s = now - max(sent_time, self._last_output_time)
            self._last_output_time = now
            if scheduler_output.total_num_scheduled_tokens:
                self._record_step(scheduler_output.total_num_scheduled_tokens, step_time_s,
                                  outputs)
        if outputs:
            self._on_outputs(self, outputs)

    async def _idle(self) -> None:
        """Sleeps until a request or an abort arrives; meanwhile repairs a store
        that lost writes (Redis came back), which only a commit does."""
        while not self._wakeup.is_set():
            try:
                await asyncio.wait_for(self._wakeup.wait(), _IDLE_STORE_CHECK_S)
            except TimeoutError:
                if self.store.wants_full_state():
                    self.scheduler.commit_store()

    def _record_step(self, num_scheduled_tokens: int, step_time_s: float,
                     outputs: dict[int, EngineCoreOutputs]) -> None:
        num_generated = sum(len(o.new_token_ids) for c in outputs.values() for o in c.outputs)
        self.num_generation_tokens += num_generated
        self.generation_history.add(num_generated, time.monotonic())
        self.metrics.observe_step(num_scheduled_tokens, step_time_s)
        finished_req_times = self.scheduler.finished_req_times
        if finished_req_times:
            self.metrics.observe_finished(finished_req_times)
            finished_req_times.clear()
