"""The chaos suite's cluster and workload: real processes, one fault at a time.

One local cluster (embedded Redis, a scheduler, two workers, two frontends;
the tiny random Llama carrying SmolLM2's tokenizer) serves the whole module,
supervised the way ``kvmesh up`` supervises it. Each scenario runs the same
mixed workload while it injects one fault, and checks what a serving system
would publish: no request lost, no block leaked, and greedy and seeded
outputs equal to a fault-free run.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import pytest

from kvmesh.client import Client
from kvmesh.cluster import LocalCluster
from tests.e2e.helpers import all_blocks_free, tiny_cluster_config, wait_for
from tests.e2e.tiny_model import save_tiny_llama

# Fails requests that ask with extra_args={"poison": "refuse" | "raise" | "nan"}.
POISON_PROCESSOR = "tests.worker.sample.kvmesh_test_logitsprocs:PoisonAdapter"
# Codes a client sees when its frontend or connection goes away: it retries
# the request (on the other frontend), as any client of a replicated service does.
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


@dataclass(frozen=True)
class Job:
    """One request of the workload."""

    name: str
    prompt: str
    max_tokens: int
    sampling: dict = field(default_factory=dict)


WORKLOAD = [
    *(Job(f"greedy-{i}", f"Story number {i}: once upon a time", 160 + 8 * i,
          dict(temperature=0.0, ignore_eos=True)) for i in range(6)),
    *(Job(f"shared-{i}", "A long shared introduction that many requests start with. " * 3
          + f"Then part {i}.", 120, dict(temperature=0.0, ignore_eos=True)) for i in range(3)),
    *(Job(f"seeded-{i}", f"Seeded run {i}", 140,
          dict(temperature=1.0, top_p=0.9, seed=100 + i, ignore_eos=True)) for i in range(2)),
    Job("pair", "Two answers to one question", 100,
        dict(temperature=1.0, seed=7, n=2, ignore_eos=True)),
]


@dataclass
class Outcome:
    tokens: dict[str, list[list[int]]]
    failures: dict[str, str]
    num_retries: int


def run_job(addresses: list[str], job: Job, first_token: threading.Event) -> tuple[list, int]:
    """Streams one job, retrying on the next frontend when its stream is lost."""
    num_retries = 0
    start = WORKLOAD.index(job)  # the jobs spread over the frontends
    while True:
        address = addresses[(start + num_retries) % len(addresses)]
        try:
            with Client(address, timeout_s=120) as client:
                outputs: dict[int, list[int]] = {}
                for chunk in client.generate(job.prompt, max_tokens=job.max_tokens,
                                             **job.sampling):
                    first_token.set()
                    for output in chunk.outputs:
                        outputs.setdefault(output.index, []).extend(output.token_ids)
                return [outputs[i] for i in sorted(outputs)], num_retries
        except grpc.RpcError as e:
            if e.code() not in RETRYABLE or num_retries >= 3:
                raise
            num_retries += 1
            time.sleep(1.0)


def run_workload(cluster: LocalCluster, fault: Callable[[], None] | None = None) -> Outcome:
    """Runs WORKLOAD (4 at a time); ``fault`` fires once generation is under way."""
    first_token = threading.Event()
    with ThreadPoolExecutor(4) as pool:
        futures = {job.name: pool.submit(run_job, cluster.frontend_addresses, job, first_token)
                   for job in WORKLOAD}
        if fault is not None:
            assert first_token.wait(60)
            fault()
        tokens, failures, num_retries = {}, {}, 0
        for name, future in futures.items():
            try:
                tokens[name], retries = future.result(timeout=300)
                num_retries += retries
            except grpc.RpcError as e:
                failures[name] = f"{e.code().name}: {e.details()}"
    return Outcome(tokens, failures, num_retries)


class Supervisor:
    """Calls ``cluster.supervise()`` every half second, as ``kvmesh up`` does."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.restarted: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.restarted.extend(self.cluster.supervise())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, default_model_dir):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), default_model_dir)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory) -> Iterator[LocalCluster]:
    config = tiny_cluster_config(
        tiny_model_dir, tmp_path_factory.mktemp("logs"), num_workers=2, num_frontends=2,
        scheduler_args=["--max-num-seqs", "4", "--worker-step-timeout-s", "3"],
    )
    # Only the workers run it, so poisoned requests get past the frontends.
    config = dataclasses.replace(config, worker_args=[*config.worker_args, "--logits-processors",
                                                      POISON_PROCESSOR])
    cluster = LocalCluster(config).start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def supervisor(cluster) -> Iterator[Supervisor]:
    supervisor = Supervisor(cluster)
    yield supervisor
    supervisor.stop()


@pytest.fixture(scope="module")
def baseline(cluster, supervisor) -> Outcome:
    """The fault-free run every scenario is compared with."""
    started = time.monotonic()
    outcome = run_workload(cluster)
    assert not outcome.failures
    print(f"\nchaos: no fault: {len(outcome.tokens)} requests in "
          f"{time.monotonic() - started:.1f} s")
    return outcome


def wait_idle(cluster: LocalCluster, timeout_s: float = 60) -> None:
    """Every worker back, serving, with its whole pool free (nothing leaked)."""
    for frontend in cluster.frontends:
        frontend.wait_serving(time.monotonic() + timeout_s)
    with Client(cluster.address, timeout_s=30) as client:
        wait_for(lambda: len(client.stats().workers) == len(cluster.workers)
                 and all_blocks_free(client), timeout_s=timeout_s, what="cluster idle")
