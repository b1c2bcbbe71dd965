"""The frontend's Prometheus metrics: request-level latencies and token counts, under
vLLM's names and labels (vLLM's PrometheusStatLogger).

The frontend sees what a client sees, so time to first token, inter-token
latency, end-to-end latency and time per output token are measured here; the
scheduler reports queues, KV cache and per-phase times on its own endpoint.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from services.common.engine import FinishReason
from services.common.prometheus import (
    INTER_TOKEN_BUCKETS_S,
    REQUEST_LATENCY_BUCKETS_S,
    TTFT_BUCKETS_S,
    build_1_2_5_buckets,
)
from services.frontend.metrics import IterationStats

if TYPE_CHECKING:
    from services.frontend.engine_cells import EngineCells


class PrometheusStatLogger:
    """Every frontend metric, labelled ``model_name``, in a registry of its own."""

    def __init__(self, model_name: str, max_model_len: int) -> None:
        self.model_name = model_name
        self.registry = registry = CollectorRegistry()
        labels = ("model_name",)
        token_buckets = build_1_2_5_buckets(max_model_len)

        def histogram(name: str, documentation: str, buckets) -> Histogram:
            return Histogram(name, documentation, labels, buckets=buckets,
                             registry=registry).labels(model_name)

        def counter(name: str, documentation: str) -> Counter:
            return Counter(name, documentation, labels, registry=registry).labels(model_name)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          ("model_name", "finished_reason"), registry=registry)
        self.request_success = {str(reason): success.labels(model_name, str(reason))
                                for reason in FinishReason}
        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            TTFT_BUCKETS_S)
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            INTER_TOKEN_BUCKETS_S)
        self.time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.", INTER_TOKEN_BUCKETS_S)
        self.e2e_request_latency = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS_S)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets)
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.",
            token_buckets)

    def record(self, stats: IterationStats) -> None:
        """Adds one EngineCoreOutputs message's worth of observations."""
        if stats.num_prompt_tokens:
            self.prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self.generation_tokens.inc(stats.num_generation_tokens)
        for ttft_s in stats.time_to_first_tokens_s:
            self.time_to_first_token.observe(ttft_s)
        for itl_s in stats.inter_token_latencies_s:
            self.inter_token_latency.observe(itl_s)
        for finished in stats.finished_requests:
            self.request_success[finished.finish_reason].inc()
            self.e2e_request_latency.observe(finished.e2e_latency_s)
            self.request_prompt_tokens.observe(finished.num_prompt_tokens)
            self.request_generation_tokens.observe(finished.num_generation_tokens)
            if finished.mean_time_per_output_token_s is not None:
                self.time_per_output_token.observe(finished.mean_time_per_output_token_s)

    def record_aborted(self, num_requests: int) -> None:
        """Requests the client left before they finished."""
        self.request_success[str(FinishReason.ABORT)].inc(num_requests)

    def observe_cells(self, cells: EngineCells) -> None:
        """Adds the cells' state, read at each scrape (nothing per request)."""
        self.registry.register(_CellCollector(self.model_name, cells))


class _CellCollector:
    """Per cell: load, workers, whether its stream is up, requests routed by reason."""

    def __init__(self, model_name: str, cells: EngineCells) -> None:
        self._model_name = model_name
        self._cells = cells

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name", "cell"]
        load = GaugeMetricFamily("kvmesh:cell_load_tokens",
                                 "The cell's load as routing weighs it: prompt tokens to "
                                 "compute plus a weight per request.", labels=labels)
        workers = GaugeMetricFamily("kvmesh:cell_num_workers",
                                    "Workers registered in the cell.", labels=labels)
        up = GaugeMetricFamily("kvmesh:cell_connected",
                               "1 while this frontend's stream to the cell is up.", labels=labels)
        routed = CounterMetricFamily("kvmesh:cell_routed_requests",
                                     "Requests this frontend sent to the cell, by reason "
                                     "(prefix, load, fallback, resubmit).",
                                     labels=[*labels, "reason"])
        for cell in list(self._cells.cells.values()):
            key = [self._model_name, cell.name]
            load.add_metric(key, cell.load_tokens(self._cells.request_weight))
            workers.add_metric(key, cell.num_workers)
            up.add_metric(key, 1.0 if cell.client.connected else 0.0)
            for reason, count in cell.routed.items():
                routed.add_metric([*key, reason], count)
        yield from (load, workers, up, routed)
