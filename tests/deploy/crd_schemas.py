"""The CRD schemas that the chart's custom resources are validated against.

They come from the npm registry, pinned: ``@kubernetes-models/keda@0.3.2``
carries KEDA v2.10.1's ScaledObject schema and
``@kubernetes-models/prometheus-operator@4.0.0`` prometheus-operator
v0.57.0's ServiceMonitor schema, each generated from the project's CRD YAML
(its ``openAPIV3Schema``) by ``crd-generate`` and shipped as a JSON literal in
the model's module. ``npm pack`` fetches the tarball (npm checks its
integrity) into a cache once; nothing here is written by hand.

Two things are added, both what the API server does: ``metadata`` is checked
as Kubernetes' ObjectMeta (from kubernetes-validate's schemas), and unknown
fields are refused (strict field validation; the API server prunes or refuses
them, a CRD schema alone lets them through).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
from kubernetes_validate.utils import schema_contents
from referencing import Registry, Resource

from services.common.model_files import cache_root

_OBJECT_META_REF = ("https://kubernetes.io/api/_definitions.json"
                    "#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta")
_SCHEMA_START = "const schema = "
_NPM_TIMEOUT_S = 120


@dataclass(frozen=True)
class CrdSource:
    """Where one custom resource's schema lies in an npm package."""

    package: str
    version: str
    module: str  # path of the model's module inside the tarball

    @property
    def tarball_name(self) -> str:
        return f"{self.package.lstrip('@').replace('/', '-')}-{self.version}.tgz"


CRD_SOURCES: dict[tuple[str, str], CrdSource] = {
    ("keda.sh/v1alpha1", "ScaledObject"): CrdSource(
        "@kubernetes-models/keda", "0.3.2", "package/keda.sh/v1alpha1/ScaledObject.js"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"): CrdSource(
        "@kubernetes-models/prometheus-operator", "4.0.0",
        "package/monitoring.coreos.com/v1/ServiceMonitor.js"),
}


def npm_unavailable_reason() -> str | None:
    """Why the schemas cannot be fetched here, or None."""
    if shutil.which("npm") is None:
        return "npm is not installed: the CRD schemas come from the npm registry"
    return None


def _tarball(source: CrdSource, cache_dir: Path) -> Path:
    path = cache_dir / source.tarball_name
    if not path.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run(["npm", "pack", f"{source.package}@{source.version}",
                        "--pack-destination", str(cache_dir)],
                       check=True, capture_output=True, timeout=_NPM_TIMEOUT_S)
    return path


def _schema_literal(module_text: str, module: str) -> dict[str, Any]:
    """The JSON object assigned to ``schema`` in a generated model module."""
    start = module_text.find(_SCHEMA_START)
    end = module_text.find("\n};\n", start)
    if start < 0 or end < 0:
        raise ValueError(f"{module}: no `const schema = {{...}};` literal")
    return json.loads(module_text[start + len(_SCHEMA_START):end + 2])


def _refuse_unknown_fields(schema: Any) -> Any:
    """``schema`` with additionalProperties false wherever it lists properties
    and says nothing about others (a structural schema's pruning, made strict)."""
    if isinstance(schema, list):
        return [_refuse_unknown_fields(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    strict = {key: _refuse_unknown_fields(value) for key, value in schema.items()}
    if "properties" in strict and "additionalProperties" not in strict:
        strict["additionalProperties"] = False
    return strict


def crd_validator(api_version: str, kind: str, k8s_version: str,
                  cache_dir: Path | None = None) -> jsonschema.Validator:
    """A strict validator of ``kind`` from its CRD schema; metadata as ObjectMeta
    of ``k8s_version`` (e.g. "1.37.0")."""
    source = CRD_SOURCES[(api_version, kind)]
    with tarfile.open(_tarball(source, cache_dir or cache_root() / "crd-schemas")) as archive:
        member = archive.extractfile(source.module)
        if member is None:
            raise ValueError(f"{source.tarball_name} has no {source.module}")
        schema = _schema_literal(member.read().decode(), source.module)
    properties = dict(schema["properties"])
    properties.pop("metadata")
    schema = _refuse_unknown_fields({**schema, "properties": properties})
    schema["properties"]["metadata"] = {"$ref": _OBJECT_META_REF}
    definitions = schema_contents(
        f"kubernetes-json-schema/v{k8s_version}-local-strict/_definitions.json", k8s_version)
    registry = Resource.from_contents(definitions) @ Registry()
    return jsonschema.Draft202012Validator(schema, registry=registry)
