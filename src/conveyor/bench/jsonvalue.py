"""JSON at the file edge: one alias for a JSON value, and a checked reader for JSON objects.

Run directories, study files and server answers arrive as JSON. Each is read once, at the edge, into a
typed record; `Fields` is how: every read names the type it expects, and a wrong type is an error that
names the file and the key. A missing key gives the caller's default, because older run directories
lack keys that newer ones write.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeAlias, Union

JSON: TypeAlias = Union[str, int, float, bool, None, list["JSON"], dict[str, "JSON"]]
"""Any JSON value, as json.loads returns it: what a file's opaque metadata holds (a trace header's
`generator`), and what a reader gets from another tool's file before it checks the fields it needs."""
JSONObject: TypeAlias = dict[str, JSON]
"""A JSON object."""


class JsonShapeError(ValueError):
    """A JSON value of the wrong type; the message names where it was read."""


def _number(value: JSON, where: str) -> float:
    if value == "inf":  # summary.json writes an unbounded rate or interval end as "inf"
        return math.inf
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise JsonShapeError(f"{where}: expected a number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Fields:
    """A JSON object read key by key; `where` names it in errors (a file and a path inside it)."""

    data: Mapping[str, JSON]
    """The object."""
    where: str
    """e.g. 'runs/a/summary.json: server'."""

    @classmethod
    def of(cls, value: JSON, where: str) -> Fields:
        if value is None:
            return cls({}, where)
        if not isinstance(value, dict):
            raise JsonShapeError(f"{where}: expected an object, got {value!r}")
        return cls(value, where)

    def _at(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def raw(self, key: str) -> JSON:
        return self.data[key] if key in self.data else None

    def opt_number(self, key: str) -> float | None:
        value = self.raw(key)
        return None if value is None else _number(value, self._at(key))

    def number(self, key: str, default: float = 0.0) -> float:
        found = self.opt_number(key)
        return default if found is None else found

    def opt_integer(self, key: str) -> int | None:
        found = self.opt_number(key)
        return None if found is None else int(found)

    def integer(self, key: str, default: int = 0) -> int:
        found = self.opt_integer(key)
        return default if found is None else found

    def opt_text(self, key: str) -> str | None:
        value = self.raw(key)
        return None if value is None else str(value)

    def text(self, key: str, default: str = "") -> str:
        found = self.opt_text(key)
        return default if found is None else found

    def flag(self, key: str, default: bool) -> bool:
        value = self.raw(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise JsonShapeError(f"{self._at(key)}: expected true or false, got {value!r}")
        return value

    def child(self, key: str) -> Fields:
        return Fields.of(self.raw(key), self._at(key))

    def children(self) -> dict[str, Fields]:
        """Every value of this object as an object (a table keyed by name)."""
        return {k: Fields.of(v, self._at(k)) for k, v in self.data.items()}

    def numbers(self) -> dict[str, float | None]:
        """Every numeric (or null) value of this object; other values are left out."""
        return {k: None if v is None else _number(v, self._at(k)) for k, v in self.data.items()
                if v is None or v == "inf" or (isinstance(v, (int, float)) and not isinstance(v, bool))}

    def number_list(self, key: str) -> tuple[float, ...]:
        value = self.raw(key)
        if value is None:
            return ()
        if not isinstance(value, list):
            raise JsonShapeError(f"{self._at(key)}: expected a list, got {value!r}")
        return tuple(_number(v, f"{self._at(key)}[{i}]") for i, v in enumerate(value))

    def text_list(self, key: str) -> tuple[str, ...]:
        value = self.raw(key)
        if value is None:
            return ()
        if not isinstance(value, list):
            raise JsonShapeError(f"{self._at(key)}: expected a list, got {value!r}")
        return tuple(str(v) for v in value)
