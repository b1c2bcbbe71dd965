"""A worker's Prometheus metrics: what its model runs, step by step.

Queues, KV usage and request latencies are the scheduler's and the
frontend's (vLLM's names live there); a worker reports the cost of the steps
it executes, labelled ``model_name`` and ``worker_id``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.common.prometheus import STEP_TIME_BUCKETS_S

LABELS = ("model_name", "worker_id")


class WorkerMetrics:
    """The metrics of one worker process, in a registry of its own.

    Labels are bound once the model is known (``bind``); until then nothing
    is reported.
    """

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.registry = CollectorRegistry()
        self._execute_time = Histogram(
            "kvmesh:worker_execute_time_seconds",
            "Time to execute one step (inputs, forward pass, sampling), in seconds.",
            LABELS, buckets=STEP_TIME_BUCKETS_S, registry=self.registry)
        self._steps = Counter("kvmesh:worker_steps", "Steps executed.", LABELS,
                              registry=self.registry)
        self._tokens = Counter("kvmesh:worker_scheduled_tokens",
                               "Tokens computed (prompt and generated), over all steps.",
                               LABELS, registry=self.registry)
        self._num_kv_blocks = Gauge("kvmesh:worker_num_kv_blocks",
                                    "KV cache blocks allocated, the null block included.",
                                    LABELS, registry=self.registry)

    def bind(self, model_name: str, num_kv_blocks: int) -> None:
        labels = (model_name, self.worker_id)
        self.execute_time = self._execute_time.labels(*labels)
        self.steps = self._steps.labels(*labels)
        self.tokens = self._tokens.labels(*labels)
        self._num_kv_blocks.labels(*labels).set(num_kv_blocks)

    def observe_step(self, num_scheduled_tokens: int, execute_time_s: float) -> None:
        """One executed step; call only after ``bind``."""
        self.execute_time.observe(execute_time_s)
        self.steps.inc()
        self.tokens.inc(num_scheduled_tokens)
