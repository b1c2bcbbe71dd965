"""The engine core in this process (vLLM V1's EngineCore behind its InprocClient).

A Scheduler drives one Worker directly, with no gRPC in between: what the
offline ``LLM`` API and tests use. The caller sees only EngineCoreRequests
going in and EngineCoreOutputs coming out, exactly as over the wire.

With asynchronous scheduling the worker runs on a StepPipeline thread and the
next step is scheduled (and prepared by the worker) while it computes the
current one (vLLM's batch queue), as with a remote worker.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future

from services.common.engine import EngineCoreOutputs, EngineCoreRequest
from services.common.model_runner_output import ModelRunnerOutput
from services.common.registration import WorkerRegistration
from services.common.scheduler_output import SchedulerOutput
from services.scheduler.config import SchedulingOptions, make_scheduler_config
from services.scheduler.kv_store import KVStore
from services.scheduler.request import RequestStatus
from services.scheduler.scheduler import Scheduler
from services.worker.config import WorkerConfig
from services.worker.step_pipeline import StepPipeline
from services.worker.worker import Worker


class EngineCore:
    """One scheduler and one worker stepping together in this process.

    Up to ``max_steps_in_flight`` steps are handed to the worker before the
    oldest one's output is applied (2: asynchronous scheduling, the worker on
    its StepPipeline's thread; 1: synchronous, in the caller's thread).
    """

    def __init__(self, scheduler: Scheduler, worker: Worker, max_steps_in_flight: int = 1) -> None:
        self.scheduler = scheduler
        self.worker = worker
        self.max_steps_in_flight = max_steps_in_flight
        self._batch_queue: deque[tuple[SchedulerOutput, Future[ModelRunnerOutput]]] = deque()
        self._pipeline = StepPipeline(worker) if max_steps_in_flight > 1 else None
        if self._pipeline is not None:
            # The pipeline's thread holds the worker: stop it once this core is
            # dropped, or the model and KV cache (GPU memory) outlive ``del llm``.
            # Not at exit: the process frees everything then, and waiting on a
            # step in flight would only delay it.
            weakref.finalize(self, self._pipeline.close).atexit = False

    @classmethod
    def create(
        cls,
        worker_config: WorkerConfig,
        options: SchedulingOptions | None = None,
        store: KVStore | None = None,
    ) -> EngineCore:
        """Loads the model, sizes the KV cache, and builds a scheduler for that pool
        (as the scheduler service does for a worker that registers)."""
        worker = Worker(worker_config)
        worker.load_model()
        worker.initialize_kv_cache()
        options = options or SchedulingOptions()
        config = make_scheduler_config(options, worker.registration_info(), engine_index=0)
        return cls(Scheduler(config, store), worker, options.max_steps_in_flight)

    @property
    def worker_info(self) -> WorkerRegistration:
        return self.worker.registration_info()

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queues a request (see Scheduler.add_request for what it raises)."""
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Finishes requests as aborted; unknown or finished ids are ignored."""
        request_ids = list(request_ids)
        if request_ids:
            self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_requests(self) -> bool:
        """Whether a step() could still produce outputs."""
        return self.scheduler.has_requests() or bool(self._batch_queue)

    def step(self) -> EngineCoreOutputs:
        """Schedules a step for the worker while there is room in flight, then
        applies the oldest step's output (none yet, right after filling the
        first slot of an empty pipeline).

        The worker runs even when nothing is scheduled and nothing is in
        flight, so it drops the state of requests that finished meanwhile.
        """
        queue = self._batch_queue
        if len(queue) < self.max_steps_in_flight and self.scheduler.has_requests():
            scheduler_output = self.scheduler.schedule()
            if (scheduler_output.total_num_scheduled_tokens or scheduler_output.finished_req_ids
                    or not queue):
                queue.append((scheduler_output, self._submit(scheduler_output)))
                if len(queue) < self.max_steps_in_flight:
                    return EngineCoreOutputs(engine_index=self.scheduler.config.engine_index)
        if not queue:
            return EngineCoreOutputs(engine_index=self.scheduler.config.engine_index)
        scheduler_output, runner_output = queue.popleft()
        return self._update(scheduler_output, runner_output.result())

    def _submit(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        if self._pipeline is not None:
            return self._pipeline.submit(scheduler_output)
        done: Future[ModelRunnerOutput] = Future()
        done.set_result(self.worker.execute_model(scheduler_output))
        return done

    def _update(self, scheduler_output: SchedulerOutput,
                runner_output: ModelRunnerOutput) -> EngineCoreOutputs:
        outputs_by_client = self.scheduler.update_from_output(scheduler_output, runner_output)
        merged = EngineCoreOutputs(engine_index=self.scheduler.config.engine_index)
        for client_outputs in outputs_by_client.values():
            merged.outputs.extend(client_outputs.outputs)
            merged.timestamp = client_outputs.timestamp
        return merged
