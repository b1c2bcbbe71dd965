"""Plugins by name: installed entry points, and ``"module.path:QualName"`` strings.

Logits processors are found this way in two processes: the worker builds
them, and the frontend runs their ``validate_params`` on every request at
admission (as vLLM does), so a request they refuse never reaches a worker.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

LOGITS_PROCESSORS_GROUP = "kvmesh.logits_processors"


def load_entry_points(group: str) -> list[tuple[str, object]]:
    """(name, loaded object) of every installed entry point of ``group``.

    Raises RuntimeError naming the plugin that failed to import.
    """
    loaded = []
    for entry_point in entry_points(group=group):
        try:
            loaded.append((entry_point.name, entry_point.load()))
        except Exception as e:
            raise RuntimeError(f"failed to load plugin {entry_point.name!r} "
                               f"({entry_point.value}) of {group}") from e
    return loaded


def load_qualname(spec: str) -> object:
    """Imports ``"module.path:QualName"`` (QualName may be dotted, for nested classes).

    Raises ValueError for a malformed spec or a missing attribute, RuntimeError
    when the module fails to import.
    """
    module_path, sep, qualname = spec.partition(":")
    if not sep or not module_path or not qualname:
        raise ValueError(f"plugin {spec!r} must be written 'module.path:ClassName'")
    try:
        obj: object = importlib.import_module(module_path)
    except Exception as e:
        raise RuntimeError(f"failed to import module {module_path!r} for plugin {spec!r}") from e
    for attr in qualname.split("."):
        try:
            obj = getattr(obj, attr)
        except AttributeError as e:
            raise ValueError(f"plugin {spec!r}: {attr!r} not found") from e
    return obj
