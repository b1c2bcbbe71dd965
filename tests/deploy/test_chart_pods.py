"""The chart's pods, run: every pod the rendered manifests ask for (Redis, the
schedulers, the workers, the frontends) as a process on a host of its own
(a network namespace with its own address and hostname, tests/netns.py),
started from the rendered command, args, env (the rendered Secret's values)
and ports, finding its peers through the Services' names, and probed as the
kubelet probes it (tests/deploy/kubelet.py). Then a request goes end to end
through each frontend's address with the API key the chart generated, and a
frontend cut off from its scheduler leaves its Service without a restart.

What stands in for Kubernetes is listed in tests/deploy/pods.py; the tiny
model keeps start-up short (this is about plumbing).
"""

from __future__ import annotations

import contextlib
import io
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("helm_python", reason="helm-python-sdk (the chart's tests) is not installed")

import openai  # noqa: E402
import redis  # noqa: E402

from kvmesh.cluster import ServiceProcess, stop_all  # noqa: E402
from tests.deploy.chart import NAMESPACE, render  # noqa: E402
from tests.deploy.kubelet import PodProbes, probes_for  # noqa: E402
from tests.deploy.pods import (  # noqa: E402
    Pod,
    container_argv,
    container_env,
    dns_names,
    hook_test_pods,
    image_programs,
    pods_of,
    secrets_of,
)
from tests.e2e.helpers import (  # noqa: E402
    TINY_MAX_MODEL_LEN,
    metric_sum,
    tiny_cluster_config,
    wait_for,
)
from tests.netns import VirtualNetwork, netns_unavailable_reason  # noqa: E402

pytestmark = pytest.mark.skipif(netns_unavailable_reason() is not None,
                                reason=str(netns_unavailable_reason()))

PROBE_PORTS = {"redis": "redis", "scheduler": "grpc", "worker": "health", "frontend": "grpc"}
# The slowest start the chart's startup probes allow (the worker's 5 s x 120).
STARTUP_BUDGET_S = 600.0


def cells_supported() -> bool:
    """Whether the scheduler takes --cell-id, i.e. cells (issue 23) are merged."""
    from services.scheduler import server

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            server.parse_args(["--cell-id", "probe"])
    except SystemExit:
        return False
    return True


def chart_values(model_dir: Path, num_cells: int) -> dict:
    """The chart's defaults, on the tiny model, sized for a 2-core machine."""
    return {
        "model": {"path": str(model_dir), "maxModelLen": TINY_MAX_MODEL_LEN},
        "scheduler": {"replicas": num_cells, "extraArgs": ["--max-num-seqs", "4"]},
        "worker": {"replicas": 2, "extraArgs": tiny_cluster_config(model_dir, Path()).worker_args},
    }


@dataclass
class ChartCluster:
    num_cells: int
    manifests: list[dict]
    network: VirtualNetwork
    pods: list[Pod]
    secrets: dict[str, dict[str, str]]
    processes: dict[str, ServiceProcess]
    probes: dict[str, PodProbes]

    def of(self, component: str) -> list[Pod]:
        return [p for p in self.pods if p.component == component]

    def api_key(self) -> str:
        (data,) = [d for name, d in self.secrets.items() if name.endswith("-secrets")]
        return data["api-keys"].split(",")[0]

    def all_ready(self) -> bool:
        for name, probes in self.probes.items():
            if probes.startup_failed or not self.processes[name].alive():
                raise RuntimeError(f"{name} failed to start (startup probe failed: "
                                   f"{probes.startup_failed})\n{self.processes[name].log_tail()}")
        return all(p.ready for p in self.probes.values())


def _start_pod(network: VirtualNetwork, pod: Pod, log_dir: Path,
               programs: dict[str, str]) -> tuple[ServiceProcess, PodProbes]:
    host = network.hosts[pod.name]
    probe_port = pod.port(PROBE_PORTS[pod.component])
    process = ServiceProcess(pod.name, host.command(container_argv(pod, programs)),
                             f"{pod.ip}:{probe_port}", log_dir / f"{pod.name}.log", pod.env)
    return process, probes_for(pod.name, pod.container, pod.ip, pod.port).start()


@pytest.fixture(scope="module", params=[1, 2], ids=["one-cell", "two-cells"])
def chart_cluster(request, tiny_model_dir, tmp_path_factory) -> Iterator[ChartCluster]:
    num_cells = request.param
    if num_cells > 1 and not cells_supported():
        pytest.skip("two cells need several schedulers behind one name (cells, issue 23): "
                    "today's scheduler has no --cell-id")
    manifests, _ = render(chart_values(tiny_model_dir, num_cells))
    pods, secrets = pods_of(manifests), secrets_of(manifests)
    log_dir = tmp_path_factory.mktemp("pod-logs")
    processes: dict[str, ServiceProcess] = {}
    probes: dict[str, PodProbes] = {}
    with VirtualNetwork("chart") as network:
        for pod in pods:
            pod.ip = network.add_host(pod.name).ip
        network.write_hosts_files(dns_names(manifests, pods, NAMESPACE))
        programs = image_programs()
        try:
            for pod in pods:  # all at once, in no order, as a cluster starts them
                pod.env = container_env(pod, secrets, NAMESPACE)
                processes[pod.name], probes[pod.name] = _start_pod(network, pod, log_dir,
                                                                   programs)
            cluster = ChartCluster(num_cells, manifests, network, pods, secrets, processes,
                                   probes)
            wait_for(cluster.all_ready, timeout_s=STARTUP_BUDGET_S, what="every pod Ready")
            yield cluster
        finally:
            for p in probes.values():
                p.stop()
            stop_all(list(processes.values()), grace_s=10)


def test_the_chart_asks_for_each_kind_of_pod(chart_cluster):
    counts = {c: len(chart_cluster.of(c)) for c in PROBE_PORTS}
    assert counts == {"redis": 1, "scheduler": chart_cluster.num_cells,
                      "worker": 2, "frontend": 2}  # frontends: the autoscaler's minimum
    assert [p.name for p in chart_cluster.of("scheduler")] == [
        f"demo-kvmesh-scheduler-{i}" for i in range(chart_cluster.num_cells)]


def test_every_pod_started_and_is_ready_under_its_probes(chart_cluster):
    for name, probes in chart_cluster.probes.items():
        assert not probes.startup_failed and probes.ready, name
        assert probes.liveness_restarts == 0, name
        startup = probes.startup
        if startup is not None:  # passed within what the probe allows
            assert probes.startup_s <= startup.initial_delay_s + \
                startup.period_s * startup.failure_threshold + startup.timeout_s, name
    # gRPC probes asked the services themselves, on their health ports.
    worker = chart_cluster.probes[chart_cluster.of("worker")[0].name]
    assert worker.liveness.action == {"grpc": {"port": 50053, "service": "liveness"}}
    assert any(kind == "readiness" and ok for _, kind, ok in worker.history)


def test_the_schedulers_mirror_to_the_charts_redis_with_its_password(chart_cluster):
    (redis_pod,) = chart_cluster.of("redis")
    redis_host = chart_cluster.network.hosts[redis_pod.name]
    for pod in chart_cluster.of("scheduler"):
        # $KVMESH_REDIS_URL: the URL from the Secret, password inside.
        assert pod.ip in redis_host.connected_peers(redis_pod.port("redis"))
        metrics = f"http://{pod.ip}:{pod.port('metrics')}/metrics"
        assert metric_sum(metrics, "kvmesh:redis_mirror_errors_total") == 0
    port = redis_pod.port("redis")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host=redis_pod.ip, port=port, socket_timeout=5).set("k", "v")
    password = redis_pod.env["REDIS_PASSWORD"]
    assert redis.Redis(host=redis_pod.ip, port=port, password=password).keys("kvmesh:*")
    for pod in chart_cluster.of("scheduler") + chart_cluster.of("frontend"):
        # As the kubelet expands it: the password is in the environment only.
        assert password not in " ".join(container_argv(pod, image_programs())), pod.name


def _openai_client(pod: Pod, api_key: str) -> openai.OpenAI:
    (http_port,) = [p["containerPort"] for p in pod.container["ports"] if p["name"] == "http"]
    return openai.OpenAI(base_url=f"http://{pod.ip}:{http_port}/v1", api_key=api_key,
                         max_retries=0, timeout=60)


def test_a_request_is_served_end_to_end_through_each_frontend(chart_cluster):
    for pod in chart_cluster.of("frontend"):
        client = _openai_client(pod, chart_cluster.api_key())
        stream = client.chat.completions.create(
            model=client.models.list().data[0].id, max_tokens=12, temperature=0, stream=True,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        chunks = list(stream)
        assert chunks[-1].choices[0].finish_reason == "length", pod.name
        assert "".join(c.choices[0].delta.content or "" for c in chunks), pod.name
        # The key came from the chart's Secret: without it the frontend refuses.
        with pytest.raises(openai.AuthenticationError):
            _openai_client(pod, "not-a-key").models.list()


def test_a_frontend_cut_off_from_its_scheduler_leaves_its_service_unrestarted(chart_cluster):
    frontends = [chart_cluster.probes[p.name] for p in chart_cluster.of("frontend")]
    schedulers = chart_cluster.of("scheduler")
    for pod in schedulers:
        chart_cluster.network.partition(chart_cluster.network.hosts[pod.name])
    try:
        wait_for(lambda: not any(f.ready for f in frontends), timeout_s=60,
                 what="frontends out of their Service (not Ready)")
    finally:
        for pod in schedulers:
            chart_cluster.network.heal(chart_cluster.network.hosts[pod.name])
    wait_for(chart_cluster.all_ready, timeout_s=120, what="every pod Ready again")
    assert all(p.liveness_restarts == 0 for p in chart_cluster.probes.values())


def test_helm_test_passes(chart_cluster):
    """`helm test`: the chart's test pod, run on a host of its own, exits 0."""
    (pod,) = hook_test_pods(chart_cluster.manifests)
    host = chart_cluster.network.add_host(pod.name)
    pod.ip = host.ip
    pod.env = container_env(pod, chart_cluster.secrets, NAMESPACE)
    done = subprocess.run(host.command(container_argv(pod, image_programs())),
                          capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout.strip()) == (0, "SERVING"), done.stderr
