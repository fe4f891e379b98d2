"""Load a script of benchmarks/ as a module, for tests of what runs without its hardware."""

import importlib.util
import pathlib
import sys
from types import ModuleType

BENCHMARKS = pathlib.Path(__file__).parents[2] / "benchmarks"


def load_script(relative: str) -> ModuleType:
    """benchmarks/<relative> as a module named by its stem (registered: dataclasses resolve it by name)."""
    path = BENCHMARKS / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module
