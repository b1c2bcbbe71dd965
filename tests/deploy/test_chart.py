"""The Helm chart, offline: `helm lint --strict`, every manifest checked against
the Kubernetes schemas (strict: unknown fields refused) and every custom
resource against its CRD's schema, for each values file in the chart's ci/;
then what the manifests wire together (probes, addresses, secrets, scaling).

The running side (the rendered pods as processes, each on its own address)
is tests/deploy/test_chart_pods.py.
"""

from __future__ import annotations

import base64
import re
import shutil
from pathlib import Path

import pytest

pytest.importorskip("helm_python", reason="helm-python-sdk (the chart's tests) is not installed")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

from tests.deploy.chart import (  # noqa: E402
    CHART_DIR,
    CI_VALUES_FILES,
    NAMESPACE,
    container,
    find,
    lint,
    load_values,
    one,
    render,
)
from tests.deploy.crd_schemas import CRD_SOURCES, crd_validator, npm_unavailable_reason  # noqa: E402

# The oldest Kubernetes the chart supports (Chart.yaml's kubeVersion: native
# gRPC probes) and the newest kubernetes-validate knows.
K8S_VERSIONS = ("1.27.0", kubernetes_validate.utils.latest_version())
WORKLOADS = ("scheduler", "worker", "frontend")


def _values_id(path: Path) -> str:
    return path.name.removesuffix("-values.yaml")


@pytest.fixture(params=CI_VALUES_FILES, ids=_values_id)
def values(request) -> dict:
    return load_values(request.param)


def test_ci_values_files_exist():
    assert {_values_id(p) for p in CI_VALUES_FILES} >= {
        "default", "cells-keda-monitoring", "external-redis", "gpu"}


def test_helm_lint_strict_passes(values):
    report = lint(values)
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # warnings and errors
    assert not report["errors"] and not problems, report


def test_lint_strict_fails_on_a_broken_template(tmp_path):
    # The lint above could fail: a chart with an unknown function does not lint.
    import helm_python as helm

    broken = shutil.copytree(CHART_DIR, tmp_path / "kvmesh")
    (broken / "templates" / "bad.yaml").write_text("x: {{ no_such_function }}\n")
    report = helm.lint(str(broken), {}, strict=True)
    assert report["errors"] or any(m["severity"] == 3 for m in report["messages"])


@pytest.mark.parametrize("k8s_version", K8S_VERSIONS)
def test_every_manifest_is_valid_kubernetes(values, k8s_version):
    manifests, _ = render(values)
    custom = []
    for manifest in manifests:
        if (manifest["apiVersion"], manifest["kind"]) in CRD_SOURCES:
            custom.append(manifest)
            continue
        try:
            kubernetes_validate.validate(manifest, k8s_version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            pytest.fail(f"{manifest['kind']}/{manifest['metadata']['name']}: {path}: {e.message}")
    if custom:
        if (reason := npm_unavailable_reason()) is not None:
            pytest.skip(reason)
        for manifest in custom:
            validator = crd_validator(manifest["apiVersion"], manifest["kind"], k8s_version)
            errors = [f"{'.'.join(map(str, e.path))}: {e.message}"
                      for e in validator.iter_errors(manifest)]
            assert not errors, f"{manifest['kind']}: {errors}"


def test_crd_validation_refuses_an_unknown_field_and_a_wrong_type():
    if (reason := npm_unavailable_reason()) is not None:
        pytest.skip(reason)
    manifests, _ = render(load_values(_ci("cells-keda-monitoring")))
    scaled = one(manifests, "ScaledObject", "worker")
    validator = crd_validator("keda.sh/v1alpha1", "ScaledObject", K8S_VERSIONS[-1])
    assert validator.is_valid(scaled)
    assert not validator.is_valid({**scaled, "spec": {**scaled["spec"], "replicas": 3}})
    assert not validator.is_valid({**scaled, "spec": {**scaled["spec"], "minReplicaCount": "2"}})
    (monitor,) = find(manifests, "ServiceMonitor")
    validator = crd_validator("monitoring.coreos.com/v1", "ServiceMonitor", K8S_VERSIONS[-1])
    assert validator.is_valid(monitor)
    assert not validator.is_valid({**monitor, "spec": {**monitor["spec"], "endpoint": []}})


def _ci(name: str) -> Path:
    return next(p for p in CI_VALUES_FILES if _values_id(p) == name)


# ------------------------------------------------------------------ wiring


def _args(workload) -> list[str]:
    return container(workload)["args"]


def _env(workload) -> dict[str, dict]:
    return {e["name"]: e for e in container(workload)["env"]}


def _secret_data(manifests) -> dict[str, str]:
    (secret,) = find(manifests, "Secret")
    return {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}


def test_probes_are_native_grpc_on_each_services_health(values):
    manifests, _ = render(values)
    for name in WORKLOADS:
        workload = find(manifests, "StatefulSet", name) + find(manifests, "Deployment", name)
        c = container(workload[0])
        port = {"worker": "health"}.get(name, "grpc")
        (port_number,) = [p["containerPort"] for p in c["ports"] if p["name"] == port]
        for probe in ("startupProbe", "livenessProbe"):
            assert c[probe]["grpc"] == {"port": port_number, "service": "liveness"}, (name, probe)
        assert c["readinessProbe"]["grpc"] == {"port": port_number}, name
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert c[probe]["periodSeconds"] > 0 and c[probe]["failureThreshold"] > 0


def test_workers_and_frontends_dial_the_schedulers_headless_service(values):
    manifests, _ = render(values)
    statefulset = one(manifests, "StatefulSet", "scheduler")
    service = one(manifests, "Service", "scheduler")
    assert service["spec"]["clusterIP"] == "None"
    assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    assert _selects(service["spec"]["selector"], statefulset)
    host = f"{service['metadata']['name']}.{NAMESPACE}.svc.cluster.local"
    (grpc_port,) = [p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc"]
    for name in ("worker", "frontend"):
        assert f"--scheduler-address={host}:{grpc_port}" in _args(one(manifests, "Deployment", name))


def _selects(selector: dict, workload) -> bool:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    return selector.items() <= labels.items()


def test_every_selector_matches_its_pods(values):
    manifests, _ = render(values)
    workloads = find(manifests, "Deployment") + find(manifests, "StatefulSet")
    for workload in workloads:
        assert _selects(workload["spec"]["selector"]["matchLabels"], workload)
    for kind, path in (("Service", ("spec", "selector")),
                       ("PodDisruptionBudget", ("spec", "selector", "matchLabels"))):
        for manifest in find(manifests, kind):
            selector = manifest[path[0]][path[1]] if len(path) == 2 else \
                manifest["spec"]["selector"]["matchLabels"]
            matched = [w for w in workloads if _selects(selector, w)]
            assert len(matched) == 1, f"{kind}/{manifest['metadata']['name']} selects {len(matched)}"


def test_secrets_are_generated_when_not_given():
    first, _ = render({})
    second, _ = render({})
    a, b = _secret_data(first), _secret_data(second)
    assert set(a) == {"cluster-secret", "redis-password", "redis-url", "api-keys",
                      "admin-api-keys", "metrics-api-key"}
    for key in ("cluster-secret", "redis-password", "api-keys", "admin-api-keys"):
        assert a[key] != b[key] and len(a[key]) >= 32, key
    # The URL carries the generated password and names the built-in Redis Service.
    redis_service = one(first, "Service", "redis")["metadata"]["name"]
    assert a["redis-url"] == (f"redis://:{a['redis-password']}@{redis_service}.{NAMESPACE}"
                              ".svc.cluster.local:6379/0")
    assert a["metrics-api-key"] == a["admin-api-keys"]


def test_given_secrets_are_kept_and_no_secret_is_on_a_command_line():
    manifests, _ = render(load_values(_ci("external-redis")))
    data = _secret_data(manifests)
    assert data["cluster-secret"] == "a-cluster-secret-given-in-values"
    assert data["redis-url"] == "rediss://:s3cret@redis.example.internal:6380/2"
    assert "api-keys" not in data and not find(manifests, "Deployment", "redis")
    for manifest in find(manifests, "Deployment") + find(manifests, "StatefulSet"):
        command_line = " ".join(container(manifest)["command"] + container(manifest)["args"])
        assert "s3cret" not in command_line and "a-cluster-secret" not in command_line
    scheduler = one(manifests, "StatefulSet", "scheduler")
    # The URL (password inside) is read from the environment: a flag of
    # $(KVMESH_REDIS_URL) would be expanded by the kubelet onto argv.
    assert not any(a.startswith("--redis-url") for a in _args(scheduler))
    for workload in (scheduler, one(manifests, "Deployment", "frontend")):
        assert _env(workload)["KVMESH_REDIS_URL"]["valueFrom"]["secretKeyRef"]["key"] == "redis-url"
    frontend_env = _env(one(manifests, "Deployment", "frontend"))
    assert "KVMESH_API_KEY" not in frontend_env  # auth.enabled false


def test_given_api_keys_reach_the_frontends():
    manifests, _ = render(load_values(_ci("gpu")))
    data = _secret_data(manifests)
    assert (data["api-keys"], data["admin-api-keys"], data["metrics-api-key"]) == (
        "tenant-a,tenant-b", "ops", "ops")
    env = _env(one(manifests, "Deployment", "frontend"))
    assert env["KVMESH_API_KEY"]["valueFrom"]["secretKeyRef"]["key"] == "api-keys"
    assert env["KVMESH_ADMIN_API_KEY"]["valueFrom"]["secretKeyRef"]["key"] == "admin-api-keys"


def test_an_existing_secret_replaces_the_generated_one():
    manifests, _ = render({"secrets": {"existingSecret": "mine"}})
    assert not find(manifests, "Secret")
    refs = {e["valueFrom"]["secretKeyRef"]["name"]
            for kind in ("Deployment", "StatefulSet") for w in find(manifests, kind)
            for e in container(w)["env"] if "valueFrom" in e}
    assert refs == {"mine"}


def test_without_redis_no_service_is_given_a_redis_url():
    manifests, _ = render({"redis": {"enabled": False}})
    assert "redis-url" not in _secret_data(manifests)
    for kind in ("Deployment", "StatefulSet"):
        for workload in find(manifests, kind):
            assert "KVMESH_REDIS_URL" not in _env(workload)
            assert not any(a.startswith("--redis-url") for a in _args(workload))


def test_frontends_autoscale_on_cpu_and_workers_keep_their_count_by_default():
    manifests, _ = render({})
    (hpa,) = find(manifests, "HorizontalPodAutoscaler")
    frontend = one(manifests, "Deployment", "frontend")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": frontend["metadata"]["name"]}
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    assert "replicas" not in frontend["spec"]  # the autoscaler owns it
    assert one(manifests, "Deployment", "worker")["spec"]["replicas"] == 2
    assert not find(manifests, "ScaledObject") and not find(manifests, "ServiceMonitor")


def test_keda_scales_the_workers_on_queue_and_kv_cache_metrics():
    manifests, _ = render(load_values(_ci("cells-keda-monitoring")))
    scaled = one(manifests, "ScaledObject", "worker")
    worker = one(manifests, "Deployment", "worker")
    assert scaled["spec"]["scaleTargetRef"]["name"] == worker["metadata"]["name"]
    assert "replicas" not in worker["spec"]
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (2, 16)
    triggers = {t["name"]: t for t in scaled["spec"]["triggers"]}
    waiting, usage = triggers["waiting-requests"], triggers["kv-cache-usage"]
    assert waiting["metadata"]["query"].startswith("sum(vllm:num_requests_waiting{")
    assert (waiting["metricType"], waiting["metadata"]["threshold"]) == ("AverageValue", "8")
    assert usage["metadata"]["query"].startswith("avg(vllm:kv_cache_usage_perc{")
    assert (usage["metricType"], usage["metadata"]["threshold"]) == ("Value", "0.85")
    scheduler = one(manifests, "Service", "scheduler")["metadata"]["name"]
    assert f'service="{scheduler}"' in waiting["metadata"]["query"]
    # Nothing else scales the workers.
    assert all(h["spec"]["scaleTargetRef"]["name"] != worker["metadata"]["name"]
               for h in find(manifests, "HorizontalPodAutoscaler"))
    assert one(manifests, "StatefulSet", "scheduler")["spec"]["replicas"] == 2


def test_the_service_monitor_scrapes_every_metrics_port():
    manifests, _ = render(load_values(_ci("cells-keda-monitoring")))
    (monitor,) = find(manifests, "ServiceMonitor")
    ports = {e["port"] for e in monitor["spec"]["endpoints"]}
    services = find(manifests, "Service")
    named = {p["name"] for s in services for p in s["spec"]["ports"]}
    assert ports <= named
    assert {s["metadata"]["name"].rsplit("-", 1)[1] for s in services
            if any(p["name"] in ports for p in s["spec"]["ports"])} == set(WORKLOADS)
    http = next(e for e in monitor["spec"]["endpoints"] if e["port"] == "http")
    assert http["authorization"]["credentials"]["key"] == "metrics-api-key"
    for service in services:
        assert monitor["spec"]["selector"]["matchLabels"].items() <= \
            service["metadata"]["labels"].items()
    assert monitor["metadata"]["labels"]["release"] == "prometheus"


@pytest.mark.parametrize("values, message", [
    # values.schema.json: types, ranges and unknown keys (a typo) refused.
    ({"worker": {"replicas": "two"}}, "at '/worker/replicas': got string, want integer"),
    ({"worker": {"replica": 3}}, "at '/worker': additional properties 'replica' not allowed"),
    ({"keda": {"enabled": True, "kvCacheUsage": 1.5}}, "at '/keda/kvCacheUsage': maximum"),
    ({"redis": {"enabled": False, "externalUrl": "redis.example:6379"}},
     "at '/redis/externalUrl'"),
    # The templates: what spans several keys.
    ({"keda": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}},
     "keda.minReplicas (5) must be <= keda.maxReplicas (2)"),
    ({"frontend": {"autoscaling": {"minReplicas": 9}}},
     "frontend.autoscaling.minReplicas (9) must be <= frontend.autoscaling.maxReplicas (8)"),
])
def test_bad_values_fail_naming_the_value(values, message):
    import helm_python as helm

    with pytest.raises(helm.HelmError, match=re.escape(message)):
        render(values)


def test_notes_tell_how_to_reach_and_authenticate():
    _, notes = render({})
    assert "port-forward svc/demo-kvmesh-frontend 50051 8000" in notes
    assert "jsonpath='{.data.api-keys}'" in notes
    _, notes = render(load_values(_ci("external-redis")))
    assert "API keys are OFF" in notes
