"""The folder rule, executable: which layer may import which, and no import cycles.

Every import counts: module level, inside functions, and under
``if TYPE_CHECKING:``. The layers (ARCHITECTURE.md, STYLE.md):

- ``services/common``: imports only itself;
- ``services/frontend``, ``services/scheduler``: themselves and common;
- ``services/worker``: itself, common and ``kernels``;
- ``kernels``: only itself;
- ``kvmesh.offline``: anything (the one place that runs all services in-process);
- the rest of ``kvmesh`` (CLI, local cluster, client): itself and common.

The generated ``kvmesh.v1`` code is the contract every layer may import.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
ROOTS = ("services", "kernels", "kvmesh")
PROTO = "kvmesh.v1"

ALLOWED: dict[str, frozenset[str]] = {
    "common": frozenset({"common"}),
    "frontend": frozenset({"frontend", "common"}),
    "scheduler": frozenset({"scheduler", "common"}),
    "worker": frozenset({"worker", "common", "kernels"}),
    "kernels": frozenset({"kernels"}),
    "kvmesh": frozenset({"kvmesh", "common"}),
    "offline": frozenset({"offline", "kvmesh", "common", "frontend", "scheduler", "worker",
                          "kernels"}),
    "services": frozenset(),  # the bare namespace package
}
# Third-party packages a layer must never import: the scheduler holds no tensors
# and no grammars (structured outputs live in the worker).
FORBIDDEN_PACKAGES: dict[str, frozenset[str]] = {
    "scheduler": frozenset({"torch", "numpy", "xgrammar"})}


def layer_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "services":
        return parts[1] if len(parts) > 1 else "services"
    if parts[0] == "kvmesh" and len(parts) > 1 and parts[1] == "offline":
        return "offline"
    return parts[0]


def source_modules() -> dict[str, Path]:
    """Module name -> file for every source file (generated proto code excluded)."""
    modules: dict[str, Path] = {}
    for root in ROOTS:
        for path in sorted((REPO_ROOT / root).rglob("*.py")):
            parts = path.relative_to(REPO_ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join(parts)
            if name != PROTO and not name.startswith(PROTO + "."):
                modules[name] = path
    return modules


def imported_names(path: Path, module: str) -> Iterator[tuple[str, int]]:
    """(absolute dotted name, line) of every import in the file, wherever it stands."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                # "from pkg import name": the edge goes to pkg.name when it is a module.
                yield f"{base}.{alias.name}", node.lineno
            yield base, node.lineno


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest source module that ``name`` names or lies in, else None."""
    if name == PROTO or name.startswith(PROTO + "."):
        return None  # the generated contract: every layer may import it
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> tuple[dict[str, set[str]], dict[tuple[str, str], int]]:
    """Edges between source modules, and the line of each edge (for messages)."""
    modules = source_modules()
    edges: dict[str, set[str]] = {name: set() for name in modules}
    lines: dict[tuple[str, str], int] = {}
    for module, path in modules.items():
        for name, line in imported_names(path, module):
            target = resolve(name, modules)
            if target is not None and target != module:
                edges[module].add(target)
                lines.setdefault((module, target), line)
    return edges, lines


def strongly_connected_components(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components of one module are left out."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(edges[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return components


def test_no_import_cycles() -> None:
    edges, _ = import_graph()
    cycles = strongly_connected_components(edges)
    assert not cycles, "modules that import each other in a loop:\n" + "\n".join(
        " <-> ".join(component) for component in cycles
    )


def test_layers_import_only_what_they_may() -> None:
    edges, lines = import_graph()
    bad = [
        f"{source} -> {target} (line {lines[(source, target)]})"
        for source, targets in sorted(edges.items())
        for target in sorted(targets)
        if layer_of(target) not in ALLOWED[layer_of(source)]
    ]
    assert not bad, "imports across a forbidden seam:\n" + "\n".join(bad)


def test_forbidden_third_party_packages() -> None:
    modules = source_modules()
    bad = [
        f"{module} imports {name} (line {line})"
        for module, path in sorted(modules.items())
        for name, line in imported_names(path, module)
        if name.split(".")[0] in FORBIDDEN_PACKAGES.get(layer_of(module), ())
    ]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module", ["services.scheduler.server"])
def test_scheduler_process_loads_no_tensor_or_grammar_library(module: str) -> None:
    """What the scheduler process actually loads, through every module it imports."""
    code = (f"import sys, {module}; "
            "print(','.join(sorted({'torch', 'numpy', 'xgrammar'} & set(sys.modules))))")
    loaded = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True,
                            capture_output=True, text=True).stdout.strip()
    assert loaded == ""


def test_the_walk_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The rule counts imports under TYPE_CHECKING, inside functions and relative ones."""
    path = tmp_path / "mod.py"
    path.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from services.scheduler.request import Request\n"
        "def f():\n    import services.worker.worker\n"
        "from .sibling import thing\n"
    )
    names = {name for name, _ in imported_names(path, "services.common.mod")}
    assert {"services.scheduler.request.Request", "services.worker.worker",
            "services.common.sibling.thing"} <= names
