"""The engine core inside the frontend's process (vLLM V1's InprocClient).

A Scheduler drives one Worker directly, with no gRPC in between: what the
offline ``LLM`` API and tests use. The frontend sees only EngineCoreRequests
going in and EngineCoreOutputs coming out, exactly as over the wire.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.common.engine import EngineCoreOutputs, EngineCoreRequest
from services.common.registration import WorkerRegistration
from services.scheduler.config import SchedulerConfig
from services.scheduler.kv_store import KVStore
from services.scheduler.request import RequestStatus
from services.scheduler.scheduler import Scheduler
from services.worker.worker import Worker, WorkerConfig


class InprocEngineCore:
    """One scheduler and one worker stepping together in this process."""

    def __init__(self, scheduler: Scheduler, worker: Worker) -> None:
        self.scheduler = scheduler
        self.worker = worker

    @classmethod
    def create(
        cls,
        worker_config: WorkerConfig,
        *,
        long_prefill_token_threshold: int = 0,
        scheduling_policy: str = "fcfs",
        enable_prefix_caching: bool = True,
        store: KVStore | None = None,
    ) -> InprocEngineCore:
        """Loads the model, sizes the KV cache, and builds a scheduler for that pool."""
        worker = Worker(worker_config)
        worker.load_model()
        worker.initialize_kv_cache()
        info = worker.registration_info()
        config = SchedulerConfig(
            num_blocks=info.num_blocks,
            block_size=info.block_size,
            max_num_batched_tokens=info.max_num_batched_tokens,
            max_num_seqs=info.max_num_seqs,
            max_model_len=info.max_model_len,
            long_prefill_token_threshold=long_prefill_token_threshold,
            policy=scheduling_policy,
            enable_prefix_caching=enable_prefix_caching,
        )
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
