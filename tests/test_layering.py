"""Enforces the import table of ARCHITECTURE.md §2 on every module under src/conveyor.

Every `import` statement counts, including ones inside functions (lazy imports are still arrows).
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "conveyor"

# bench's stages in pipeline order; plan sits beside decide (it needs none of the stages before it).
BENCH_STAGES = ("trace", "load", "measure", "decide", "report", "cli")
BENCH_LAYERS = {"bench", "bench.plan", *(f"bench.{s}" for s in BENCH_STAGES)}
_SHARED = {"bench", "arith", "file_digest"}  # bench's root helpers (table_file, units) and two stdlib-only leaves
BENCH_ALLOWED: dict[str, set[str]] = {
    "bench": {"bench", "arith"},
    "bench.plan": {"bench.plan", *_SHARED},
    **{f"bench.{s}": {*(f"bench.{e}" for e in BENCH_STAGES[: i + 1]), *_SHARED} for i, s in enumerate(BENCH_STAGES)},
}
BENCH_ALLOWED["bench.trace"] |= {"gguf_header", "gguf_tokenizer"}  # trace import --tokenizer only
BENCH_ALLOWED["bench.report"].add("bench.plan")
BENCH_ALLOWED["bench.cli"] = set(BENCH_LAYERS)

# layer -> conveyor layers it may import (itself included where it has several modules).
ALLOWED: dict[str, set[str]] = {
    "arith": set(),
    "file_digest": set(),
    "config_enums": set(),
    "config": {"config_enums"},
    "gguf_header": {"arith"},
    "gguf_tokenizer": {"gguf_header", "arith"},
    "request": {"request"},
    "core": {"core", "config", "request", "arith"},
    "kernels": {"kernels", "arith"},
    "model": {"model", "kernels", "config", "gguf_header", "arith"},
    "worker": {"worker", "model", "kernels", "config", "request", "core.outputs", "arith"},
    "engine": {"engine", "core", "worker", "config", "request", "gguf_header", "gguf_tokenizer", "arith"},
    "server": {"server", "engine", "config", "request", "arith", "file_digest"},
    # bench/: one sub-package per stage; a stage imports only the stages before it (and the root helpers).
    **BENCH_ALLOWED,
    "demo": {"demo", "arith", *BENCH_LAYERS},
    # sim/: the simulator on real traces joins core (the scheduler) and bench (traces, run directories).
    "sim": {"sim", "core", "config", "request", "arith", "file_digest", *BENCH_LAYERS},
    "cli": {"*"},
}
# layer -> third-party top-level packages it must never import.
FORBIDDEN_THIRD_PARTY: dict[str, set[str]] = {
    "server": {"torch", "triton", "numpy"},
    **{layer: {"torch", "triton", "fastapi", "uvicorn", "transformers"} for layer in BENCH_LAYERS},
    "demo": {"torch", "triton"},
    "sim": {"torch", "triton", "fastapi", "uvicorn", "transformers"},
    "engine": {"triton"},
}
STDLIB_ONLY = {"arith", "file_digest", "config", "config_enums", "request", "core", "gguf_header"}


def layer_of(module: str) -> str:
    parts = module.split(".")[1:]  # drop "conveyor"
    if not parts or parts[0] in ("cli", "__main__", "__init__"):
        return "cli"
    if parts[0] in ("request", "sampling_params"):
        return "request"
    if parts[0] == "core" and parts[1:2] == ["outputs"]:
        return "core"
    if parts[0] == "bench" and len(parts) > 1 and f"bench.{parts[1]}" in BENCH_LAYERS:
        return f"bench.{parts[1]}"
    return parts[0]


def target_of(module: str) -> str:
    """The name an import is checked against: its layer, or core.outputs for the worker's one arrow."""
    if module.startswith("conveyor.core.outputs"):
        return "core.outputs"
    return layer_of(module)


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text())
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rsplit(".", 1)[0]
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                names.append(".".join(base + ([node.module] if node.module else [])))
            elif node.module:
                names.append(node.module)
    return names


def all_modules() -> list[pathlib.Path]:
    return sorted(PACKAGE.rglob("*.py"))


def is_allowed(layer: str, target: str) -> bool:
    allowed = ALLOWED[layer]
    if "*" in allowed or target in allowed:
        return True
    return target == "core.outputs" and "core" in allowed


@pytest.mark.parametrize("path", all_modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_imports_follow_the_table(path: pathlib.Path) -> None:
    layer = layer_of(module_name(path))
    assert layer in ALLOWED, f"{path}: layer {layer!r} is not in ARCHITECTURE.md's table"
    for name in imports_of(path):
        top = name.split(".")[0]
        if top == "conveyor":
            if name == "conveyor":
                continue
            target = target_of(name)
            assert is_allowed(layer, target), f"{path}: {layer} may not import {name}"
        elif layer in STDLIB_ONLY:
            assert top in sys.stdlib_module_names or top == "__future__", (
                f"{path}: {layer} must use the standard library only, imports {name}"
            )
        else:
            assert top not in FORBIDDEN_THIRD_PARTY.get(layer, set()), f"{path}: {layer} may not import {name}"


def test_table_covers_every_package() -> None:
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and not p.name.startswith("__")}
    assert packages <= set(ALLOWED), f"packages missing from the layering table: {packages - set(ALLOWED)}"


def test_bench_stages_are_the_tree() -> None:
    """Every sub-package of bench/ is a stage in the table, and every stage exists."""
    found = {f"bench.{p.name}" for p in (PACKAGE / "bench").iterdir() if (p / "__init__.py").is_file()}
    assert found == BENCH_LAYERS - {"bench"}


def test_a_stage_may_not_import_a_later_one() -> None:
    """The table itself encodes the pipeline: no stage sees one after it."""
    for i, stage in enumerate(BENCH_STAGES):
        for later in BENCH_STAGES[i + 1:]:
            assert not is_allowed(f"bench.{stage}", f"bench.{later}"), (stage, later)
    assert not is_allowed("bench.measure", "bench.plan") and not is_allowed("bench.plan", "bench.decide")


@pytest.mark.parametrize(("module", "walk"), [("conveyor", False), ("conveyor.cli", False),
                                              ("conveyor.core", True), ("conveyor.bench", True),
                                              ("conveyor.engine.types", False),
                                              # the API-process half of the engine: torch only in the core
                                              ("conveyor.engine.core_client", False),
                                              ("conveyor.engine.launcher", False),
                                              ("conveyor.engine.messages", False)])
def test_light_modules_do_not_load_torch(module: str, walk: bool) -> None:
    """The benchmark side and the core must work on a laptop without torch."""
    code = (
        "import importlib, pkgutil, sys\n"
        f"m = importlib.import_module({module!r})\n"
        f"if {walk}:\n"
        "    for info in pkgutil.walk_packages(m.__path__, m.__name__ + '.'):\n"
        "        importlib.import_module(info.name)\n"
        "sys.exit(1 if 'torch' in sys.modules else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                            env={"PYTHONPATH": str(SRC)})
    assert result.returncode == 0, f"importing {module} loaded torch or failed: {result.stderr[-2000:]}"


def test_server_modules_do_not_load_torch() -> None:
    server_modules = [module_name(p) for p in (PACKAGE / "server").glob("*.py")]
    code = "import importlib, sys\n" + "".join(
        f"importlib.import_module({m!r})\n" for m in server_modules
    ) + "sys.exit(1 if 'torch' in sys.modules else 0)\n"
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                            env={"PYTHONPATH": str(SRC)})
    assert result.returncode == 0, f"server modules loaded torch or failed: {result.stderr[-2000:]}"
