"""One registered worker: its own Scheduler (block pool) and the loop that drives it."""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Callable, Iterable

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


class WorkerSession:
    """Drives one worker: wait for work -> schedule -> step -> update -> route.

    One asyncio task per session. Exactly one step is in flight at a time: the
    next ``schedule()`` waits for the worker's output of the previous step, so
    blocks freed by an abort are never reused while the worker may still
    write them. When there is nothing to do the loop sleeps on an event that
    ``add_request`` / ``abort_requests`` set (no polling).

    Messages for the worker go through ``outbox`` (the WorkerStream handler
    sends them); None there ends the stream. Each step is recorded in
    ``metrics``; ``scheduler`` must have been built with ``log_stats``.
    """

    def __init__(self, worker_id: str, engine_index: int, scheduler: Scheduler,
                 store: KVStore, on_outputs: OutputsCallback, metrics: WorkerMetrics,
                 vocab_size: int, step_timeout_s: float | None = None,
                 fault_exit_after_step: float = 0.0) -> None:
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
        self._pending_step: SchedulerOutput | None = None
        self._pending_output: asyncio.Future[ModelRunnerOutput] | None = None
        self._task: asyncio.Task[None] | None = None
        self._draining = False
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
        """Hands the worker's output to the loop once it is checked against the step
        in flight (``worker_checks.check_runner_output``); WorkerProtocolError if not."""
        future, step = self._pending_output, self._pending_step
        if future is None or step is None:
            raise WorkerProtocolError(f"worker {self.worker_id} answered step "
                                      f"{output.step_id}, but no step is in flight")
        try:
            check_runner_output(output, step, self.vocab_size)
        except WorkerProtocolError as e:
            raise WorkerProtocolError(f"worker {self.worker_id}: {e}") from None
        if self._fault_exit_after_step and random.random() < self._fault_exit_after_step:
            os._exit(FAULT_EXIT_CODE)  # fault injection: die as SIGKILL would, mid-step
        self._pending_output = None
        future.set_result(output)

    # ------------------------------------------------------------ loop

    async def _run(self) -> None:
        scheduler = self.scheduler
        while not self._draining:
            # Cleared before looking at the queues: whatever arrives from here
            # on sets it again, so no wakeup is lost.
            self._wakeup.clear()
            if not scheduler.has_requests():
                await self._idle()
                continue
            scheduler_output = scheduler.schedule()
            step_time_s = 0.0
            if scheduler_output.total_num_scheduled_tokens or scheduler_output.finished_req_ids:
                start = time.monotonic()
                runner_output = await self._execute(scheduler_output)
                step_time_s = time.monotonic() - start
            else:
                # Nothing to compute: flush outputs of requests that finished
                # outside a step (IGNORED) without a round trip to the worker.
                runner_output = ModelRunnerOutput(step_id=scheduler_output.step_id)
            outputs = scheduler.update_from_output(scheduler_output, runner_output)
            if self.closed:
                return  # its requests were re-placed: what it produced is not theirs
            if scheduler_output.total_num_scheduled_tokens:
                self._record_step(scheduler_output.total_num_scheduled_tokens, step_time_s, outputs)
            if outputs:
                self._on_outputs(self, outputs)
            if not scheduler_output.total_num_scheduled_tokens:
                # Nothing was schedulable: only a new request or an abort can
                # change that, so sleep until one arrives instead of spinning.
                await self._idle()
        self.outbox.put_nowait(drain_message())

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

    async def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        future: asyncio.Future[ModelRunnerOutput] = asyncio.get_running_loop().create_future()
        self._pending_step = scheduler_output
        self._pending_output = future
        # Tells the worker which of the blocks it wrote the mirror now covers.
        scheduler_output.durable_step_id = self.store.durable_step_id
        self.outbox.put_nowait(step_message(scheduler_output))
        try:
            # Not wait_for: it can swallow the cancellation close() sends when the
            # answer arrives at the same moment, and a closed session must not go on.
            done, _ = await asyncio.wait((future,), timeout=self._step_timeout_s)
            if not done:
                raise WorkerStepTimeout(f"worker {self.worker_id} did not answer step "
                                        f"{scheduler_output.step_id} within "
                                        f"{self._step_timeout_s} s")
            return future.result()
        finally:
            self._pending_step = self._pending_output = None
