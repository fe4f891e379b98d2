"""No import cycles among the modules under src/conveyor.

Every import statement is an arrow, including lazy imports inside functions and imports under
`TYPE_CHECKING`: a cycle hidden behind a deferred import is still a cycle in the design.
"""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterable, Mapping

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "conveyor"

def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    """Dotted name of a source file; a package's `__init__.py` is the package itself."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules_under(package_dir: pathlib.Path) -> dict[str, pathlib.Path]:
    """Every module of the package tree, by dotted name."""
    root = package_dir.parent
    return {module_name(path, root): path for path in sorted(package_dir.rglob("*.py"))}


def _known(name: str, modules: Mapping[str, object]) -> str | None:
    """`name` if it is a module of the tree, else its nearest enclosing module (None: outside the tree)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _from_base(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a `from X import ...` names; relative levels count from the file's package."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def arrows_of(path: pathlib.Path, module: str, modules: Mapping[str, object]) -> set[str]:
    """Modules of the tree that `path` imports; `from pkg import name` is `pkg.name` when that is a module."""
    is_package = path.name == "__init__.py"
    targets: set[str | None] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(_known(alias.name, modules) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(node, module, is_package)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                targets.add(submodule if submodule in modules else _known(base, modules))
    # A module naming itself (a package importing one of its own attributes) is no cycle.
    return {target for target in targets if target is not None and target != module}


def import_graph(package_dir: pathlib.Path) -> dict[str, set[str]]:
    """Module -> the modules it imports, over the whole package tree."""
    modules = modules_under(package_dir)
    return {name: arrows_of(path, name, modules) for name, path in modules.items()}


def strongly_connected(graph: Mapping[str, Iterable[str]]) -> list[frozenset[str]]:
    """Tarjan's components of more than one node, found iteratively (no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            successor = next(successors, None)
            if successor is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    found.append(_pop_component(node, stack, on_stack))
            elif successor not in index:
                index[successor] = low[successor] = len(index)
                stack.append(successor)
                on_stack.add(successor)
                work.append((successor, iter(sorted(graph.get(successor, ())))))
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
    return [component for component in found if len(component) > 1]


def _pop_component(root: str, stack: list[str], on_stack: set[str]) -> frozenset[str]:
    """The nodes above and including `root` on Tarjan's stack: one strongly connected component."""
    members: set[str] = set()
    while True:
        node = stack.pop()
        on_stack.discard(node)
        members.add(node)
        if node == root:
            return frozenset(members)


def test_cycle_finder_on_a_synthetic_graph() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d", "f"}, "f": set(), "g": {"a"}}
    assert sorted(map(sorted, strongly_connected(graph))) == [["a", "b", "c"], ["d", "e"]]
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_arrows_resolve_submodules_relative_and_lazy_imports(tmp_path: pathlib.Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    for name in ("__init__.py", "a.py", "b.py", "sub/__init__.py", "sub/c.py"):
        (pkg / name).write_text("")
    (pkg / "sub" / "__init__.py").write_text("VALUE = 1\n")
    (pkg / "a.py").write_text("from pkg.sub import c, VALUE\nimport os\n\ndef f():\n    from . import b\n")
    (pkg / "sub" / "c.py").write_text("from .. import a\nfrom ..sub import VALUE\nimport pkg.b.missing\n")
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.sub.c", "pkg.sub", "pkg.b"}
    assert graph["pkg.sub.c"] == {"pkg.a", "pkg.sub", "pkg.b"}
    assert strongly_connected(graph) == [frozenset({"pkg.a", "pkg.sub.c"})]


def test_no_import_cycles_in_src() -> None:
    cycles = [sorted(component) for component in strongly_connected(import_graph(PACKAGE))]
    assert not cycles, f"import cycles (every import counts, lazy ones too): {sorted(cycles)}"
