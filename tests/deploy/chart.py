"""The kvmesh Helm chart, rendered offline through Helm's own Go library
(PyPI's helm-python-sdk), as ``helm template`` would render it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

CHART_DIR = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "kvmesh"
# The values files the chart ships for its tests (and as examples).
CI_VALUES_FILES = sorted((CHART_DIR / "ci").glob("*-values.yaml"))
RELEASE = "demo"
NAMESPACE = "llm"

Manifest = dict[str, Any]


def load_values(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text()) or {}


def render(values: dict[str, Any] | None = None, *, release: str = RELEASE,
           namespace: str = NAMESPACE) -> tuple[list[Manifest], str]:
    """Every object the chart renders with ``values`` (in template order), and
    NOTES.txt."""
    import helm_python as helm

    with helm.Chart.load(str(CHART_DIR)) as chart:
        rendered = chart.render(values or {}, name=release, namespace=namespace,
                                is_install=True)
    notes = rendered.pop(f"{CHART_DIR.name}/templates/NOTES.txt", "")
    manifests = [doc for path in sorted(rendered) for doc in yaml.safe_load_all(rendered[path])
                 if doc]
    return manifests, notes


def lint(values: dict[str, Any] | None = None) -> dict[str, Any]:
    """``helm lint --strict`` (warnings count as errors) with ``values``."""
    import helm_python as helm

    return helm.lint(str(CHART_DIR), values or {}, strict=True, namespace=NAMESPACE)


def find(manifests: list[Manifest], kind: str, name: str | None = None) -> list[Manifest]:
    """The manifests of ``kind`` (whose name ends with ``-<name>`` when given)."""
    return [m for m in manifests if m["kind"] == kind
            and (name is None or m["metadata"]["name"].endswith(f"-{name}"))]


def one(manifests: list[Manifest], kind: str, name: str) -> Manifest:
    found = find(manifests, kind, name)
    assert len(found) == 1, f"{len(found)} {kind} named *-{name}"
    return found[0]


def container(workload: Manifest) -> dict[str, Any]:
    """The one container of a Deployment's or StatefulSet's pod template."""
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    return only
