"""SHA-256 digests of a model's files, the one definition the server (conveyor:model_info) and the
benchmark (summary.json `fixed`, for servers that do not report them) share, so that a digest the
server reports and one the benchmark computes from the same files are equal.

A single file is its own digest; several files give one digest over "name:digest" lines in name order.
A GGUF file holds config, weights and tokenizer at once, so all three digests are the file's.
"""

from __future__ import annotations

import hashlib
import pathlib
from collections.abc import Iterable
from dataclasses import dataclass

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "special_tokens_map.json")
_HASHES: dict[tuple[str, int, int], str] = {}
"""File hash memo by (path, size, mtime): a sweep hashes a model's weights once, not once per run."""


def file_sha256(path: pathlib.Path) -> str:
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _HASHES:
        digest = hashlib.sha256()
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
        _HASHES[key] = digest.hexdigest()
    return _HASHES[key]


def files_sha256(paths: Iterable[pathlib.Path]) -> str | None:
    """One digest over several files (names and contents); None when there are none."""
    found = sorted(p for p in paths if p.is_file())
    if not found:
        return None
    if len(found) == 1:
        return file_sha256(found[0])
    return hashlib.sha256("".join(f"{p.name}:{file_sha256(p)}\n" for p in found).encode()).hexdigest()


@dataclass(frozen=True)
class ModelDigests:
    """The digests of one model's files (None: no such file, or the path is not local)."""

    config_sha256: str | None = None
    weights_sha256: str | None = None
    tokenizer_sha256: str | None = None


def model_digests(model_path: pathlib.Path | None, tokenizer_path: pathlib.Path | None = None) -> ModelDigests:
    """Digests of a GGUF file or an HF directory; `tokenizer_path` (a file or directory) overrides the
    tokenizer's."""
    config = weights = tokenizer = None
    if model_path is not None and model_path.is_file():
        config = weights = tokenizer = file_sha256(model_path)
    elif model_path is not None and model_path.is_dir():
        config = files_sha256([model_path / "config.json"])
        weights = files_sha256(p for p in model_path.iterdir() if p.suffix in WEIGHT_SUFFIXES)
        tokenizer = files_sha256(model_path / name for name in TOKENIZER_FILES)
    if tokenizer_path is not None and tokenizer_path.exists():
        tokenizer = (file_sha256(tokenizer_path) if tokenizer_path.is_file() else
                     files_sha256(tokenizer_path / name for name in TOKENIZER_FILES))
    return ModelDigests(config_sha256=config, weights_sha256=weights, tokenizer_sha256=tokenizer)
