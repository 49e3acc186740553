"""The packages depend one way (kernels -> collectives -> models -> generation -> server, bench,
eval -> cli) and no module imports itself back through others, counting imports inside
functions: a circle hides in a lazy import as well as in a module's head."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("equarx_serve", "eval", "models")

# A module may import modules of its own layer or of a lower one.
LAYERS = (
    ("equarx_serve.arguments", "equarx_serve.cache_root"),
    ("equarx_serve.kernels",),
    ("equarx_serve.collectives",),
    ("models",),
    ("equarx_serve.distributed",),
    ("equarx_serve.generation",),
    ("equarx_serve.server", "equarx_serve.bench", "eval"),
    ("equarx_serve.cli", "equarx_serve.__main__", "equarx_serve"),
)


@dataclasses.dataclass(frozen=True)
class Graph:
    edges: dict[str, set[str]]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> Graph:
    paths = [p for package in PACKAGES for p in (ROOT / package).rglob("*.py")]
    modules = {module_name(p): p for p in paths}
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    edges[module].add(submodule if submodule in modules else node.module)
            elif isinstance(node, ast.Import):
                edges[module].update(alias.name for alias in node.names)
        edges[module] = {t for t in edges[module] if t in modules and t != module}
    return Graph(edges)


def cycles(graph: Graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.edges[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while (member := stack.pop()) != node:
                component.append(member)
            if component:
                found.append(sorted([node, *component]))

    for node in sorted(graph.edges):
        if node not in index:
            visit(node)
    return found


def layer(module: str) -> int:
    """The layer of the longest prefix that names `module` or a package above it."""
    best, best_length = None, -1
    for number, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_length:
                best, best_length = number, len(prefix)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS")
    return best


def test_no_module_imports_itself_back():
    assert cycles(import_graph()) == []


def test_imports_go_down_the_layers_only():
    graph = import_graph()
    upward = sorted(
        f"{source} -> {target}"
        for source, targets in graph.edges.items()
        for target in targets
        if layer(target) > layer(source)
    )
    assert upward == []


def test_the_check_sees_a_circle_and_an_upward_import():
    graph = Graph({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()})
    assert cycles(graph) == [["a", "b", "c"]]
    assert layer("equarx_serve.kernels.native") < layer("equarx_serve.cli.serve")


@pytest.mark.parametrize("module", ["equarx_serve.cli.processes", "eval.command"])
def test_every_module_has_a_layer(module):
    assert module in import_graph().edges
    layer(module)
