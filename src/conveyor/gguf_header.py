"""The header of a llama.cpp GGUF file (metadata and tensor table), read with `struct` alone.

Shared by the model loader (weights) and the tokenizer (vocabulary, merges, chat template), which sit
in layers that may not import each other. `gguf.GGUFReader` wraps each of the ~50k vocabulary strings
in numpy views and takes seconds; this reads a header in a fraction of that. Tensor data is not read.
"""

from __future__ import annotations

import pathlib
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

# GGUF metadata value types: struct codes of the scalars, and the two compound types.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    """The file is not a GGUF we can read."""


@dataclass(frozen=True)
class GGUFTensorEntry:
    """One row of the tensor table."""

    name: str
    """llama.cpp tensor name."""
    shape: tuple[int, ...]
    """Logical shape in PyTorch order (GGUF lists dims innermost first; this is reversed)."""
    ggml_type: int
    """Storage type id (GGMLQuantizationType value: F32, F16, Q4_1, Q8_0, ...)."""
    offset_bytes: int
    """Absolute byte offset of the data in the file."""


@dataclass(frozen=True)
class GGUFHeader:
    """Metadata and tensor table of one GGUF file."""

    path: pathlib.Path
    metadata: dict[str, Any]
    tensors: list[GGUFTensorEntry]


def read_gguf_metadata(path: str | pathlib.Path) -> dict[str, Any]:
    """The key/value metadata only (the tensor table is not read)."""
    with open(path, "rb") as handle:
        return _read_metadata(handle, pathlib.Path(path))[1]


def read_gguf_header(path: str | pathlib.Path) -> GGUFHeader:
    """Metadata and tensor table, with absolute data offsets."""
    path = pathlib.Path(path)
    with open(path, "rb") as handle:
        num_tensors, metadata = _read_metadata(handle, path)
        table = [_read_tensor_entry(handle) for _ in range(num_tensors)]
        alignment = int(metadata.get("general.alignment", 32))
        data_start = -(-handle.tell() // alignment) * alignment
    tensors = [GGUFTensorEntry(name, shape, ggml_type, data_start + offset)
               for name, shape, ggml_type, offset in table]
    return GGUFHeader(path=path, metadata=metadata, tensors=tensors)


def _read_metadata(handle: BinaryIO, path: pathlib.Path) -> tuple[int, dict[str, Any]]:
    if handle.read(4) != b"GGUF":
        raise GGUFFormatError(f"{str(path)!r} is not a GGUF file")
    version, num_tensors, num_kv = struct.unpack("<IQQ", handle.read(20))
    if version < 2:
        raise GGUFFormatError(f"{str(path)!r}: GGUF version {version} is too old (need >= 2)")
    metadata: dict[str, Any] = {}
    for _ in range(num_kv):
        key = _read_string(handle)
        (value_type,) = struct.unpack("<I", handle.read(4))
        metadata[key] = _read_value(handle, value_type)
    return num_tensors, metadata


def _read_tensor_entry(handle: BinaryIO) -> tuple[str, tuple[int, ...], int, int]:
    name = _read_string(handle)
    (num_dims,) = struct.unpack("<I", handle.read(4))
    dims = struct.unpack(f"<{num_dims}Q", handle.read(8 * num_dims))
    ggml_type, offset = struct.unpack("<IQ", handle.read(12))
    return name, tuple(reversed(dims)), ggml_type, offset


def _read_string(handle: BinaryIO) -> str:
    (length,) = struct.unpack("<Q", handle.read(8))
    return handle.read(length).decode("utf-8", errors="replace")


def _read_value(handle: BinaryIO, value_type: int) -> Any:
    if value_type == _STRING:
        return _read_string(handle)
    if value_type == _ARRAY:
        item_type, count = struct.unpack("<IQ", handle.read(12))
        if item_type in _SCALARS:  # one bulk unpack instead of `count` small ones
            code = _SCALARS[item_type]
            return list(struct.unpack(f"<{count}{code}", handle.read(struct.calcsize(code) * count)))
        return [_read_value(handle, item_type) for _ in range(count)]
    if value_type not in _SCALARS:
        raise GGUFFormatError(f"unknown GGUF metadata value type {value_type}")
    code = _SCALARS[value_type]
    return struct.unpack(f"<{code}", handle.read(struct.calcsize(code)))[0]
