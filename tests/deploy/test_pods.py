"""tests/deploy/pods.py keeps Kubernetes' rules: $(VAR) expansion, env sources,
pod counts and names, and what each Service's name resolves to."""

from __future__ import annotations

import pytest

pytest.importorskip("helm_python", reason="helm-python-sdk (the chart's tests) is not installed")

from tests.deploy.chart import NAMESPACE, render  # noqa: E402
from tests.deploy.pods import (  # noqa: E402
    Pod,
    container_env,
    dns_names,
    expand,
    pods_of,
    secrets_of,
)


@pytest.mark.parametrize("text, expected", [
    ("--redis-url=$(URL)", "--redis-url=redis://x"),
    ("$(URL)$(URL)", "redis://xredis://x"),
    ("$$(URL)", "$(URL)"),  # escaped: kept literally
    ("$(UNDEFINED)", "$(UNDEFINED)"),  # undefined: kept as written
    ("$URL and $(", "$URL and $("),
])
def test_expand_follows_the_kubelets_rules(text, expected):
    assert expand(text, {"URL": "redis://x"}) == expected


def test_env_from_values_secrets_and_fields_in_order():
    pod = Pod("p-0", {}, {}, {"env": [
        {"name": "A", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
        {"name": "B", "value": "b-$(A)"},
        {"name": "C", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "D", "valueFrom": {"secretKeyRef": {"name": "s", "key": "absent",
                                                     "optional": True}}},
    ]}, ip="10.1.2.3")
    assert container_env(pod, {"s": {"k": "secret"}}, "ns") == {
        "A": "secret", "B": "b-secret", "C": "p-0"}
    missing = Pod("p-1", {}, {}, {"env": [
        {"name": "A", "valueFrom": {"secretKeyRef": {"name": "s", "key": "absent"}}}]})
    with pytest.raises(KeyError, match="has no key 'absent'"):
        container_env(missing, {"s": {}}, "ns")


def test_pods_counts_names_and_service_names_of_the_default_chart():
    manifests, _ = render({"scheduler": {"replicas": 2}})
    pods = pods_of(manifests)
    for index, pod in enumerate(pods):
        pod.ip = f"10.0.0.{index + 10}"
    by_component: dict[str, list[Pod]] = {}
    for pod in pods:
        by_component.setdefault(pod.component, []).append(pod)
    assert {c: len(p) for c, p in by_component.items()} == {
        "redis": 1, "scheduler": 2, "worker": 2, "frontend": 2}
    assert [p.name for p in by_component["scheduler"]] == [
        "demo-kvmesh-scheduler-0", "demo-kvmesh-scheduler-1"]
    names = dns_names(manifests, pods, NAMESPACE)
    schedulers = [p.ip for p in by_component["scheduler"]]
    fqdn = f"demo-kvmesh-scheduler.{NAMESPACE}.svc.cluster.local"
    assert names[fqdn] == names["demo-kvmesh-scheduler"] == schedulers  # headless: every cell
    assert names[f"demo-kvmesh-scheduler-1.{fqdn}"] == [schedulers[1]]
    assert names[f"demo-kvmesh-frontend.{NAMESPACE}.svc"] == [
        p.ip for p in by_component["frontend"]]
    secrets = secrets_of(manifests)
    assert set(secrets["demo-kvmesh-secrets"]) >= {"cluster-secret", "redis-url"}
