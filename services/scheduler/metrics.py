"""The scheduler service's Prometheus metrics, under vLLM's names where vLLM has one.

Labels: ``model_name``, plus ``worker_id`` for what belongs to one worker.
What the schedulers already keep (queues, KV usage, prefix cache, preemptions,
evictions, the Redis mirror) is read at scrape time by a collector, so a
step pays nothing for it. What happens once per step (tokens, step time),
per finished request (queue, prefill and decode times) or per placement is
observed when it happens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.common.prometheus import (
    ITERATION_TOKENS_BUCKETS,
    REQUEST_LATENCY_BUCKETS_S,
    STEP_TIME_BUCKETS_S,
)
from services.common.stats import SchedulerStats, SpecDecodingStats
from services.scheduler.request import RequestTimes

WORKER_LABELS = ("model_name", "worker_id")


@dataclass(slots=True)
class WorkerSnapshot:
    """One worker's figures at scrape time."""

    worker_id: str
    stats: SchedulerStats
    mirror_lag_s: float  # how long its Redis mirror has been behind; 0 in sync
    num_mirror_errors: int  # failed mirror writes, cumulative


# (name, help, kind, value) of each per-worker figure the collector reports.
_WORKER_FAMILIES: tuple[tuple[str, str, type[Metric], Callable[[WorkerSnapshot], float]], ...] = (
    ("vllm:num_requests_running", "Number of requests in model execution batches.",
     GaugeMetricFamily, lambda w: w.stats.num_running_reqs),
    ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
     GaugeMetricFamily, lambda w: w.stats.num_waiting_reqs),
    ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
     GaugeMetricFamily, lambda w: w.stats.kv_cache_usage),
    ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
     CounterMetricFamily, lambda w: w.stats.prefix_cache_queries),
    ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
     CounterMetricFamily, lambda w: w.stats.prefix_cache_hits),
    ("vllm:num_preemptions", "Cumulative number of preemptions from the engine.",
     CounterMetricFamily, lambda w: w.stats.num_preemptions),
    ("kvmesh:kv_cache_evicted_blocks", "Cached KV blocks evicted to hold new KV.",
     CounterMetricFamily, lambda w: w.stats.num_evicted_blocks),
    ("kvmesh:redis_mirror_lag_seconds",
     "How long the worker's Redis mirror has been behind the scheduler's state (0: in sync).",
     GaugeMetricFamily, lambda w: w.mirror_lag_s),
    ("kvmesh:redis_mirror_errors", "Failed writes to the worker's Redis mirror.",
     CounterMetricFamily, lambda w: w.num_mirror_errors),
)


# Speculative decoding's counters (vLLM's names), for the workers that draft.
_SPEC_FAMILIES: tuple[tuple[str, str, Callable[[SpecDecodingStats], int]], ...] = (
    ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", lambda s: s.num_drafts),
    ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
     lambda s: s.num_draft_tokens),
    ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
     lambda s: s.num_accepted_tokens),
)


class _WorkersCollector(Collector):
    """Reads every worker's figures when Prometheus scrapes."""

    def __init__(self, model_name: Callable[[], str],
                 snapshots: Callable[[], Iterable[WorkerSnapshot]]) -> None:
        self._model_name = model_name
        self._snapshots = snapshots

    def describe(self) -> Iterable[Metric]:
        return []  # generated at scrape time: nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        snapshots = list(self._snapshots())
        model_name = self._model_name()
        workers = GaugeMetricFamily("kvmesh:workers", "Workers registered with this scheduler.",
                                    labels=["model_name"])
        workers.add_metric([model_name], len(snapshots))
        yield workers
        for name, documentation, kind, value in _WORKER_FAMILIES:
            family = kind(name, documentation, labels=list(WORKER_LABELS))
            for snapshot in snapshots:
                family.add_metric([model_name, snapshot.worker_id], value(snapshot))
            yield family
        yield from _spec_families(model_name, snapshots)


def _spec_families(model_name: str, snapshots: list[WorkerSnapshot]) -> Iterator[Metric]:
    drafting = [(w.worker_id, w.stats.spec_decoding) for w in snapshots
                if w.stats.spec_decoding is not None]
    if not drafting:
        return
    for name, documentation, value in _SPEC_FAMILIES:
        family = CounterMetricFamily(name, documentation, labels=list(WORKER_LABELS))
        for worker_id, spec in drafting:
            family.add_metric([model_name, worker_id], value(spec))
        yield family
    per_pos = CounterMetricFamily(
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "Accepted tokens per draft position.", labels=[*WORKER_LABELS, "position"])
    for worker_id, spec in drafting:
        for position, count in enumerate(spec.num_accepted_tokens_per_pos):
            per_pos.add_metric([model_name, worker_id, str(position)], count)
    yield per_pos


class SchedulerMetrics:
    """Every metric of one scheduler service, in a registry of its own.

    ``model_name()`` and ``snapshots()`` are called at scrape time, on the
    scheduler's event loop (see services.common.prometheus.MetricsServer).
    """

    def __init__(self, model_name: Callable[[], str],
                 snapshots: Callable[[], Iterable[WorkerSnapshot]]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_WorkersCollector(model_name, snapshots))
        registry = self.registry
        self.iteration_tokens = Histogram(
            "vllm:iteration_tokens_total", "Number of tokens per engine_step.", WORKER_LABELS,
            buckets=ITERATION_TOKENS_BUCKETS, registry=registry)
        self.step_time = Histogram(
            "kvmesh:step_time_seconds", "One step's round trip to its worker, in seconds.",
            WORKER_LABELS, buckets=STEP_TIME_BUCKETS_S, registry=registry)
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.", WORKER_LABELS,
            buckets=REQUEST_LATENCY_BUCKETS_S, registry=registry)
        self.prefill_time = Histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.", WORKER_LABELS,
            buckets=REQUEST_LATENCY_BUCKETS_S, registry=registry)
        self.decode_time = Histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.", WORKER_LABELS,
            buckets=REQUEST_LATENCY_BUCKETS_S, registry=registry)
        self.placements = Counter(
            "kvmesh:placements", "Requests placed on a worker, by why that worker was chosen: "
            "prefix_hit, least_loaded, or fallback (a better worker's queue was full).",
            ("model_name", "reason"), registry=registry)
        self.worker_failovers = Counter(
            "kvmesh:worker_failovers", "Workers lost while the scheduler was serving.",
            ("model_name",), registry=registry)
        self.requests_replaced = Counter(
            "kvmesh:requests_replaced", "Requests of a lost worker placed again on another.",
            ("model_name",), registry=registry)

    def for_worker(self, model_name: str, worker_id: str) -> WorkerMetrics:
        return WorkerMetrics(self, model_name, worker_id)


class WorkerMetrics:
    """One worker's histograms, bound to its labels once so a step only observes."""

    def __init__(self, metrics: SchedulerMetrics, model_name: str, worker_id: str) -> None:
        self._metrics = metrics
        self._labels = (model_name, worker_id)
        self.iteration_tokens = metrics.iteration_tokens.labels(*self._labels)
        self.step_time = metrics.step_time.labels(*self._labels)
        self.queue_time = metrics.queue_time.labels(*self._labels)
        self.prefill_time = metrics.prefill_time.labels(*self._labels)
        self.decode_time = metrics.decode_time.labels(*self._labels)

    def observe_step(self, num_scheduled_tokens: int, step_time_s: float) -> None:
        self.iteration_tokens.observe(num_scheduled_tokens)
        self.step_time.observe(step_time_s)

    def observe_finished(self, times: Iterable[RequestTimes]) -> None:
        for t in times:
            self.queue_time.observe(t.queue_time_s)
            self.prefill_time.observe(t.prefill_time_s)
            self.decode_time.observe(t.decode_time_s)

    def remove(self) -> None:
        """Drops this worker's series (it left; a worker id may never come back)."""
        m = self._metrics
        for histogram in (m.iteration_tokens, m.step_time, m.queue_time, m.prefill_time,
                          m.decode_time):
            histogram.remove(*self._labels)
