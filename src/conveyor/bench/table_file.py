"""Objectives, studies and price lists are JSON or TOML files, told apart by their suffix.

tomllib is in the standard library from Python 3.11; on 3.10 the same parser comes from PyPI as tomli
(a conditional dependency), so the benchmark runs on every Python the package supports.
"""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


def read_table_file(path: pathlib.Path) -> Any:
    """The parsed content of a `.toml` file, else of a JSON file."""
    text = path.read_text()
    return tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
