"""The import graph of the library: no circle among hiersync's modules, and the layers point down.

Read from the source with ``ast`` (every ``import``, also those inside functions, which run
the moment the function does; not those under ``if TYPE_CHECKING:``), so it takes
milliseconds and needs no torch.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "hiersync"


def _module_name(path: Path) -> str:
    parts = path.with_suffix("").parts
    parts = parts[len(parts) - 1 - parts[::-1].index("hiersync") :]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name | ast.Attribute) and ast.unparse(node.test).endswith("TYPE_CHECKING")


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The hiersync modules ``path`` imports at run time (a ``from package import name`` of a
    submodule counts as importing that submodule)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "hiersync")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "hiersync":
                found.add(target)
                found.update(f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    # ``from . import x`` inside a package names the package, which is already importing: not an edge
    return {m for m in found if m in modules and m != name and not name.startswith(m + ".")}


def _graph() -> dict[str, set[str]]:
    paths = sorted(ROOT.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    graph = {_module_name(p): _imports(p, modules) for p in paths}
    # importing a package's module runs the package's __init__ first (already running for its own modules)
    return {
        m: deps | {p for d in deps if (p := d.rpartition(".")[0]) in graph and not m.startswith(p + ".") and p != m}
        for m, deps in graph.items()
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def _package_level(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    return {m: {d for d in deps if d != "hiersync"} for m, deps in graph.items() if m != "hiersync"}


def test_no_module_imports_in_a_circle():
    graph = _package_level(_graph())
    core = {m for m in graph if not m.startswith(("hiersync.costmodel", "hiersync.tools"))}
    assert _cycles({m: graph[m] & core for m in core}) == []
    assert _cycles(graph) == []  # the cost model and the tools too


def test_the_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_a_lazy_import_inside_a_function_is_an_edge(tmp_path):
    pkg = tmp_path / "hiersync"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .b import g\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n")
    modules = {"hiersync", "hiersync.a", "hiersync.b"}
    assert _imports(pkg / "a.py", modules) == {"hiersync.b"}
    assert _imports(pkg / "b.py", modules) == set()


@pytest.mark.parametrize(
    ("lower", "upper"),
    [
        ("hiersync.costmodel", "hiersync.tools"),
        ("hiersync.costmodel", "hiersync.integrations"),
        ("hiersync.costmodel", "hiersync.api"),
        ("hiersync.integrations", "hiersync.tools"),
    ],
)
def test_layers_point_down(lower, upper):
    graph = _graph()
    wrong = {m: sorted(d for d in deps if d.startswith(upper)) for m, deps in graph.items() if m.startswith(lower)}
    assert {m: d for m, d in wrong.items() if d} == {}


def test_the_core_imports_no_tool_integration_or_public_surface():
    """The runtime core (hiersync/*.py but the public surface, the CLI and the package) imports
    neither tools/ nor integrations/ nor api.py: those sit above it."""
    graph = _graph()
    top = {"hiersync", "hiersync.api", "hiersync.tools.cli", "hiersync.__main__"}
    core = {m for m in graph if m.count(".") == 1 and m not in top}
    above = ("hiersync.tools", "hiersync.integrations", "hiersync.api")
    wrong = {m: sorted(d for d in graph[m] if d.startswith(above)) for m in core}
    assert {m: d for m, d in wrong.items() if d} == {}


def test_the_pure_model_never_imports_torch():
    offenders = []
    for path in sorted((ROOT / "costmodel").rglob("*.py")) + [ROOT / "schedule.py", ROOT / "levels.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "torch"]
    assert offenders == []
