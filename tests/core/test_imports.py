"""The core's modules import each other without a cycle, counting lazy and TYPE_CHECKING imports too
(a cycle that only type checking or a function body closes is still a cycle for the reader)."""

from __future__ import annotations

import ast
import pathlib

CORE = pathlib.Path(__file__).resolve().parents[2] / "src" / "conveyor" / "core"


def _core_imports(path: pathlib.Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("conveyor.core."):
            names.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            names.update(alias.name.split(".")[2] for alias in node.names if alias.name.startswith("conveyor.core."))
    return names


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module], _ = "open", stack.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state and (cycle := visit(target)) is not None:
                return cycle
        state[module], _ = "done", stack.pop()
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)) is not None:
            return cycle
    return None


def test_core_modules_import_each_other_without_a_cycle() -> None:
    graph = {path.stem: _core_imports(path) for path in CORE.glob("*.py")}
    assert _find_cycle(graph) is None, f"import cycle: {' -> '.join(_find_cycle(graph) or [])}"


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None
