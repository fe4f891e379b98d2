"""A tokenizer read from disk for exact token lengths (`conveyor trace import --tokenizer PATH`).

PATH is a tokenizer.json, a directory holding one (a Hugging Face model directory), or a GGUF file
(its vocabulary rebuilt by conveyor.gguf_tokenizer). Only the `tokenizers` package is needed (it comes
with `conveyor[engine]`, or alone with `conveyor[tokenizer]`); it is imported here, on use, so the
benchmark still installs and runs without it. Counts are what the server's tokenizer gives a prompt
sent to the completions endpoint: the tokenizer's own special tokens included (BOS where the model
adds one), no chat template.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Any


class TokenizerFileError(ValueError):
    """No tokenizer at the path, or the `tokenizers` package is missing; names --tokenizer."""


@dataclass(frozen=True)
class TokenCounter:
    """Encode, decode and count with one tokenizer."""

    backend: Any
    """The `tokenizers.Tokenizer`."""
    path: str
    """Where it was read from (recorded in the trace header)."""
    bos_token_id: int | None = None
    """Prepended to every encoding when the GGUF says add_bos_token (a tokenizer.json adds its own)."""

    def encode(self, text: str) -> list[int]:
        """Ids of text without special tokens (prompt bodies, shared blocks)."""
        return list(self.backend.encode(text, add_special_tokens=False).ids)

    def count(self, text: str) -> int:
        """Tokens of a prompt as the server sees it (special tokens included)."""
        return len(self.backend.encode(text, add_special_tokens=True).ids) + (self.bos_token_id is not None)

    def decode(self, ids: list[int]) -> str:
        return str(self.backend.decode(ids, skip_special_tokens=False))

    @property
    def num_special_tokens(self) -> int:
        """Special tokens a prompt gets on top of its body (vLLM subtracts them from --random-input-len)."""
        return int(self.backend.num_special_tokens_to_add(False)) + (self.bos_token_id is not None)

    def ordinary_ids(self) -> list[int]:
        """Every id that is not a special token, ascending (what random prompts are drawn from)."""
        special = {i for i, t in self.backend.get_added_tokens_decoder().items() if t.special}
        return [i for i in range(self.backend.get_vocab_size(with_added_tokens=True)) if i not in special]


def load_tokenizer(path: str) -> TokenCounter:
    """The tokenizer at path; errors name --tokenizer."""
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise TokenizerFileError("--tokenizer needs the tokenizers package: pip install 'conveyor[tokenizer]'") from exc
    p = pathlib.Path(path).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
    if p.suffix == ".gguf" and p.is_file():
        return _from_gguf(p)
    if not p.is_file():
        raise TokenizerFileError(f"--tokenizer {path}: expected a tokenizer.json, a directory holding one, or a .gguf")
    try:
        return TokenCounter(backend=Tokenizer.from_file(str(p)), path=str(path))
    except Exception as exc:  # noqa: BLE001 - the tokenizers package raises its own untyped errors
        raise TokenizerFileError(f"--tokenizer {path}: cannot read {p.name}: {exc}") from exc


GGUF_MODEL, GGUF_BOS_TOKEN_ID = "tokenizer.ggml.model", "tokenizer.ggml.bos_token_id"
GGUF_ADD_BOS_TOKEN = "tokenizer.ggml.add_bos_token"


@dataclass(frozen=True)
class _GgufTokenizerKeys:
    """The GGUF metadata this reader needs, read once (the rest of the header is the backend's business)."""

    model: object
    """tokenizer.ggml.model: only "gpt2" (byte-level BPE) is supported."""
    bos_token_id: int | None
    """tokenizer.ggml.bos_token_id when it is an integer."""
    add_bos_token: bool
    """tokenizer.ggml.add_bos_token (absent: false)."""

    @classmethod
    def of(cls, metadata: dict[str, Any]) -> _GgufTokenizerKeys:
        bos = metadata.get(GGUF_BOS_TOKEN_ID)
        return cls(model=metadata.get(GGUF_MODEL), bos_token_id=bos if isinstance(bos, int) else None,
                   add_bos_token=bool(metadata.get(GGUF_ADD_BOS_TOKEN, False)))


def _from_gguf(path: pathlib.Path) -> TokenCounter:
    from conveyor.gguf_tokenizer import TokenizerError, byte_level_backend, read_gguf_metadata

    try:
        metadata = read_gguf_metadata(path)
        keys = _GgufTokenizerKeys.of(metadata)
        if keys.model != "gpt2":
            raise TokenizerError(f"GGUF tokenizer model {keys.model!r} is not supported (only byte-level BPE)")
        backend = byte_level_backend(metadata)
    except TokenizerError as exc:
        raise TokenizerFileError(f"--tokenizer {path}: {exc}") from exc
    adds_bos = keys.add_bos_token and keys.bos_token_id is not None
    return TokenCounter(backend=backend, path=str(path), bos_token_id=keys.bos_token_id if adds_bos else None)
