"""The engine core in this process (vLLM V1's EngineCore behind its InprocClient).

A Scheduler drives one Worker directly, with no gRPC in between: what the
offline ``LLM`` API and tests use. The caller sees only EngineCoreRequests
going in and EngineCoreOutputs coming out, exactly as over the wire.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.common.engine import EngineCoreOutputs, EngineCoreRequest
from services.common.registration import WorkerRegistration
from services.scheduler.config import SchedulingOptions, make_scheduler_config
from services.scheduler.kv_store import KVStore
from services.scheduler.request import RequestStatus
from services.scheduler.scheduler import Scheduler
from services.worker.config import WorkerConfig
from services.worker.worker import Worker


class EngineCore:
    """One scheduler and one worker stepping together in this process."""

    def __init__(self, scheduler: Scheduler, worker: Worker) -> None:
        self.scheduler = scheduler
        self.worker = worker

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
        config = make_scheduler_config(options or SchedulingOptions(),
                                       worker.registration_info(), engine_index=0)
        return cls(Scheduler(config, store), worker)

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
        return self.scheduler.has_requests()

    def step(self) -> EngineCoreOutputs:
        """schedule -> worker.execute_model -> update_from_output, once.

        The worker runs even when nothing is scheduled, so it drops the state
        of requests that finished since the previous step.
        """
        scheduler_output = self.scheduler.schedule()
        runner_output = self.worker.execute_model(scheduler_output)
        outputs_by_client = self.scheduler.update_from_output(scheduler_output, runner_output)
        merged = EngineCoreOutputs(engine_index=self.scheduler.config.engine_index)
        for client_outputs in outputs_by_client.values():
            merged.outputs.extend(client_outputs.outputs)
            merged.timestamp = client_outputs.timestamp
        return merged
