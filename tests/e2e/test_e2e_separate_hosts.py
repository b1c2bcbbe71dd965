"""Services on separate hosts: Redis, two cells (a scheduler and two workers
each) and a frontend, each in a network namespace of its own with its own
address and hostname (tests/netns.py), finding each other by name, with mutual
TLS on the internal plane and TLS on the public API from certificates naming
each host's name and address. Workers and the frontend are given one name,
``scheduler.kvmesh.test``, that resolves to both schedulers (as a Kubernetes
headless Service does): TLS checks each scheduler's certificate against that
name. A worker cut off the network mid-generation fails over inside its cell,
a scheduler cut off has its requests finish in the other cell, Redis cut off
leaves serving untouched (routing by load meanwhile): every stream unchanged.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import redis

from kvmesh.client import Client
from kvmesh.cluster import ServiceProcess, stop_all
from kvmesh.healthcheck import check_health
from services.common.redis_server import valkey_server_binary
from services.common.security import CLUSTER_SECRET_ENV, REDIS_URL_ENV, TlsConfig
from tests.certs import CertificateAuthority
from tests.e2e.helpers import (
    TINY_MAX_MODEL_LEN,
    Streams,
    all_blocks_free,
    metric_sum,
    prompts,
    reference,
    tiny_cluster_config,
    wait_for,
)
from tests.netns import Host, VirtualNetwork, netns_unavailable_reason

pytestmark = pytest.mark.skipif(netns_unavailable_reason() is not None,
                                reason=str(netns_unavailable_reason()))

DOMAIN = "kvmesh.test"
SCHEDULERS = ("scheduler-1", "scheduler-2")
WORKERS = ("worker-1", "worker-2", "worker-3", "worker-4")
# The one name of every scheduler, as a headless Service's.
SCHEDULERS_NAME = f"scheduler.{DOMAIN}"
REDIS_PORT, SCHEDULER_PORT, METRICS_PORT = 6379, 50052, 9400
WORKER_HEALTH_PORT, FRONTEND_PORT, HTTP_PORT = 50053, 50051, 8000
# A deadline, not an expectation: a cold start compiles (minutes on a busy machine).
STARTUP_TIMEOUT_S = 600.0
# A worker that does not answer a step for this long is declared lost.
WORKER_STEP_TIMEOUT_S = 3


@dataclass
class SeparateHosts:
    """The running cluster: one host per service, the processes, the TLS files."""

    network: VirtualNetwork
    hosts: dict[str, Host]
    ca: CertificateAuthority
    client_tls: TlsConfig
    processes: dict[str, ServiceProcess] = field(default_factory=dict)

    def address(self, name: str, port: int) -> str:
        return f"{self.hosts[name].ip}:{port}"

    def client(self) -> Client:
        """A client of the frontend, over TLS, trusting the test CA alone."""
        return Client(self.address("frontend", FRONTEND_PORT), timeout_s=120,
                      tls=TlsConfig(ca_file=self.ca.ca_file))

    def scheduler_metric(self, name: str, schedulers: tuple[str, ...] = SCHEDULERS) -> float:
        """``name`` summed over ``schedulers``' /metrics."""
        return sum(metric_sum(f"http://{self.address(s, METRICS_PORT)}/metrics", name)
                   for s in schedulers)

    def scheduler_of(self, client: Client, worker_id: str) -> str:
        """The host of the scheduler whose cell ``worker_id`` is in (a cell's id
        is its scheduler's hostname:port)."""
        (cell_id,) = [w.cell_id for w in client.stats().workers if w.worker_id == worker_id]
        return next(name for name in SCHEDULERS if cell_id.startswith(_fqdn(name) + ":"))


def _fqdn(name: str) -> str:
    return f"{name}.{DOMAIN}"


def _tls_args(tls: TlsConfig) -> list[str]:
    return ["--tls-cert", tls.cert_file, "--tls-key", tls.key_file, "--tls-ca", tls.ca_file]


def _service_argv(name: str, tls: TlsConfig, model_dir: Path) -> list[str]:
    """The command line of ``name``'s service, addressing its peers by name
    (Redis' URL, password inside, comes in the environment)."""
    scheduler = f"{SCHEDULERS_NAME}:{SCHEDULER_PORT}"
    if name in SCHEDULERS:
        return [sys.executable, "-m", "services.scheduler.server", "--host", "0.0.0.0",
                "--port", str(SCHEDULER_PORT), "--metrics-port", str(METRICS_PORT),
                "--max-num-seqs", "4", "--worker-step-timeout-s", str(WORKER_STEP_TIMEOUT_S),
                *_tls_args(tls)]
    model_args = ["--model", str(model_dir), "--max-model-len", str(TINY_MAX_MODEL_LEN)]
    if name.startswith("worker"):
        worker_args = tiny_cluster_config(model_dir, Path()).worker_args
        return [sys.executable, "-m", "services.worker.server", "--scheduler-address", scheduler,
                "--worker-id", name, "--health-host", "0.0.0.0",
                "--health-port", str(WORKER_HEALTH_PORT), *model_args, *worker_args,
                *_tls_args(tls)]
    return [sys.executable, "-m", "services.frontend.server", "--host", "0.0.0.0",
            "--port", str(FRONTEND_PORT), "--http-port", str(HTTP_PORT),
            "--scheduler-address", scheduler, *model_args, *_tls_args(tls)]


def _wait_serving(process: ServiceProcess, tls: TlsConfig | None) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    status = ""
    while time.monotonic() < deadline:
        if not process.alive():
            raise RuntimeError(f"{process.name} exited before serving\n{process.log_tail()}")
        status = check_health(process.health_address, timeout_s=1.0, tls=tls)
        if status == "SERVING":
            return
        time.sleep(0.2)
    raise TimeoutError(f"{process.name} not SERVING (last: {status})\n{process.log_tail()}")


def _start_redis(cluster: SeparateHosts, password: str, log_dir: Path) -> None:
    host = cluster.hosts["redis"]
    argv = [str(valkey_server_binary()), "--bind", "0.0.0.0", "--port", str(REDIS_PORT),
            "--requirepass", password, "--save", "", "--appendonly", "no",
            "--dir", str(log_dir)]
    cluster.processes["redis"] = ServiceProcess(
        "redis", host.command(argv), f"{host.ip}:{REDIS_PORT}", log_dir / "redis.log", {})
    client = redis.Redis(host=host.ip, port=REDIS_PORT, password=password, socket_timeout=1)
    wait_for(lambda: _pings(client), timeout_s=10, what="redis answers")


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory) -> Iterator[SeparateHosts]:
    names = ("redis", *SCHEDULERS, *WORKERS, "frontend")
    tls_dir, log_dir = tmp_path_factory.mktemp("tls"), tmp_path_factory.mktemp("logs")
    with VirtualNetwork("hosts") as network:
        hosts = {name: network.add_host(name, hostname=_fqdn(name)) for name in names}
        network.write_hosts_files({SCHEDULERS_NAME: [hosts[name].ip for name in SCHEDULERS]})
        ca = CertificateAuthority(tls_dir)
        cluster = SeparateHosts(network, hosts, ca, ca.issue("client", [_fqdn("client")]))
        try:
            _start_cluster(cluster, tiny_model_dir, log_dir)
            yield cluster
        finally:
            stop_all(list(cluster.processes.values()), grace_s=10)


def _start_cluster(cluster: SeparateHosts, model_dir: Path, log_dir: Path) -> None:
    redis_password, secret = "redis-password-for-the-test", "cluster-secret-for-the-test"
    _start_redis(cluster, redis_password, log_dir)
    redis_url = f"redis://:{redis_password}@{_fqdn('redis')}:{REDIS_PORT}/0"
    for name in SCHEDULERS:
        _start_service(cluster, name, model_dir, log_dir, secret, redis_url)
    for name in SCHEDULERS:
        _wait_serving(cluster.processes[name], cluster.client_tls)
    # The frontend needs only the schedulers: it starts while the workers warm up.
    _start_service(cluster, "frontend", model_dir, log_dir, secret, redis_url)
    # Workers one at a time: each joins the cell with the fewest, so two a cell.
    for index, name in enumerate(WORKERS):
        _start_service(cluster, name, model_dir, log_dir, secret, redis_url)
        _wait_serving(cluster.processes[name], None)  # plaintext health, like a probe's
        # Registered: the next worker sees it in its cell.
        wait_for(lambda: _num_registered(cluster) == index + 1, 60, f"{name} registered")
    _wait_serving(cluster.processes["frontend"], cluster.client_tls)


def _start_service(cluster: SeparateHosts, name: str, model_dir: Path, log_dir: Path,
                   secret: str, redis_url: str) -> None:
    """Starts ``name``'s service on its host with a certificate of its own."""
    host = cluster.hosts[name]
    port = (SCHEDULER_PORT if name in SCHEDULERS else
            WORKER_HEALTH_PORT if name in WORKERS else FRONTEND_PORT)
    # A scheduler's certificate names the Service's name too.
    tls = cluster.ca.issue(name, [host.hostname, host.ip] + (
        [SCHEDULERS_NAME] if name in SCHEDULERS else []))
    env = {CLUSTER_SECRET_ENV: secret}
    if name not in WORKERS:
        env[REDIS_URL_ENV] = redis_url
    cluster.processes[name] = ServiceProcess(
        name, host.command(_service_argv(name, tls, model_dir)),
        f"{host.ip}:{port}", log_dir / f"{name}.log", env)


def _num_registered(cluster: SeparateHosts) -> int:
    return int(cluster.scheduler_metric("kvmesh:workers"))


def _every_cell_has_two_workers(client: Client) -> bool:
    cells = client.stats().cells
    return len(cells) == 2 and all(c.connected and c.num_workers == 2 for c in cells)


def test_each_service_runs_on_its_own_host_and_authenticates_its_peers(cluster):
    with cluster.client() as client:
        wait_for(lambda: _every_cell_has_two_workers(client), 30, "two cells of two workers")
        stats = client.stats()
        assert sorted(w.worker_id for w in stats.workers) == list(WORKERS)
        assert {c.cell_id for c in stats.cells} == {f"{_fqdn(s)}:{SCHEDULER_PORT}"
                                                    for s in SCHEDULERS}
        answer = client.complete("The capital of France is", max_tokens=8, temperature=0.0)
        assert len(answer.outputs[0].token_ids) == 8
        for scheduler in SCHEDULERS:
            cell_workers = {w for w in WORKERS if cluster.scheduler_of(client, w) == scheduler}
            peers = cluster.hosts[scheduler].connected_peers(SCHEDULER_PORT)
            assert {cluster.hosts[n].ip for n in (*cell_workers, "frontend")} <= peers
    # Both schedulers mirror to Redis, and the frontend reads the index there.
    assert {cluster.hosts[n].ip for n in (*SCHEDULERS, "frontend")} <= \
        cluster.hosts["redis"].connected_peers(REDIS_PORT)
    # The internal plane wants a client certificate from this CA; the public API
    # wants TLS.
    for scheduler in SCHEDULERS:
        address = cluster.address(scheduler, SCHEDULER_PORT)
        assert check_health(address, tls=cluster.client_tls) == "SERVING"
        assert check_health(address, tls=TlsConfig(ca_file=cluster.ca.ca_file)).startswith(
            "UNREACHABLE")
    assert check_health(cluster.address("frontend", FRONTEND_PORT)).startswith("UNREACHABLE")


def test_a_partitioned_worker_fails_over_in_its_cell_and_its_requests_finish(cluster):
    with cluster.client() as client:
        token_prompts = prompts(10, 4)
        # As long as the model allows: the victim's stream must still run when it is
        # cut off, and the streams start apart (one was 54 tokens in when the last
        # had its first; a stream that had ended left its worker idle at the cut).
        max_tokens = TINY_MAX_MODEL_LEN - max(map(len, token_prompts))
        expected = reference(client, token_prompts, max_tokens)
        streams = Streams(client, token_prompts, max_tokens)
        assert streams.started.wait(60)
        running = {w.worker_id: w.num_running_reqs for w in client.stats().workers}
        victim = max(running, key=running.__getitem__)
        assert running[victim] > 0
        its_scheduler = cluster.scheduler_of(client, victim)
        cluster.network.partition(cluster.hosts[victim])
        try:
            streams.join(120)
            assert streams.errors == [None] * len(token_prompts)
            assert streams.tokens == expected
            # Dropped by a step that timed out; by the keepalive if its stream had ended.
            wait_for(lambda: victim not in [w.worker_id for w in client.stats().workers],
                     timeout_s=60, what="the partitioned worker dropped")
            # Its cell's other worker took its requests.
            assert cluster.scheduler_metric("kvmesh:worker_failovers_total",
                                            (its_scheduler,)) >= 1
        finally:
            cluster.network.heal(cluster.hosts[victim])
        # Back on the network, the worker registers again, and nothing leaked.
        wait_for(lambda: len(client.stats().workers) == len(WORKERS), timeout_s=90,
                 what="the healed worker registered again")
        wait_for(lambda: all_blocks_free(client), timeout_s=30, what="every block free")


def test_a_partitioned_redis_leaves_serving_untouched(cluster):
    with cluster.client() as client:
        token_prompts = prompts(11, 4)
        expected = reference(client, token_prompts)
        errors_before = cluster.scheduler_metric("kvmesh:redis_mirror_errors_total")
        fallback_before = _routed(client, "fallback")
        cluster.network.partition(cluster.hosts["redis"])
        try:
            streams = Streams(client, token_prompts)
            streams.join(120)
            assert streams.errors == [None] * len(token_prompts)
            assert streams.tokens == expected
            # The frontend routed by load alone, and the mirrors' writes failed.
            assert _routed(client, "fallback") > fallback_before
            wait_for(lambda: cluster.scheduler_metric("kvmesh:redis_mirror_errors_total")
                     > errors_before, timeout_s=30, what="the mirror's writes failing")
        finally:
            cluster.network.heal(cluster.hosts["redis"])
        # Redis back: the mirrors catch up (no lag), and serving never stopped.
        wait_for(lambda: cluster.scheduler_metric("kvmesh:redis_mirror_lag_seconds") == 0,
                 timeout_s=60, what="the mirror caught up")
        assert list(client.complete(token_ids=token_prompts[0], max_tokens=150,
                                    temperature=0.0, ignore_eos=True).outputs[0].token_ids) == \
            expected[0]


def _routed(client: Client, reason: str) -> int:
    return sum(c.routed_requests.get(reason, 0) for c in client.stats().cells)


def test_a_partitioned_scheduler_has_its_requests_finish_in_the_other_cell(cluster):
    with cluster.client() as client:
        wait_for(lambda: _every_cell_has_two_workers(client), 90, "two cells of two workers")
        token_prompts = prompts(12, 8)
        expected = reference(client, token_prompts)
        streams = Streams(client, token_prompts)
        assert streams.started.wait(60)
        victim = cluster.hosts[SCHEDULERS[0]]
        resubmitted_before = _routed(client, "resubmit")
        cluster.network.partition(victim)
        try:
            # Noticed by the stream's keepalive (about 20 s), then resubmitted.
            streams.join(180)
            assert streams.errors == [None] * len(token_prompts)
            assert streams.tokens == expected
            assert _routed(client, "resubmit") > resubmitted_before
        finally:
            cluster.network.heal(victim)
        # Its workers joined the live cell meanwhile; the idle ones come back.
        wait_for(lambda: _every_cell_has_two_workers(client), 180, "both cells serving again")
        wait_for(lambda: all_blocks_free(client), timeout_s=30, what="every block free")


def test_a_client_without_the_ca_cannot_reach_the_frontend(cluster):
    other_dir = Path(cluster.ca.ca_file).parent / "other"
    other_dir.mkdir(exist_ok=True)
    other_ca = CertificateAuthority(other_dir)
    with Client(cluster.address("frontend", FRONTEND_PORT), timeout_s=5,
                tls=TlsConfig(ca_file=other_ca.ca_file)) as client:
        with pytest.raises(grpc.RpcError) as error:
            client.complete("hi", max_tokens=1)
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
