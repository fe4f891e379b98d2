"""Text <-> token ids, from a `tokenizer.json` or rebuilt from a GGUF file's own vocabulary.

A GGUF carries no tokenizer.json: conveyor.gguf_tokenizer rebuilds the byte-level BPE pipeline from its
metadata (shared with the benchmark). The metadata comes from `conveyor.gguf_header` (a small struct
parser: `gguf.GGUFReader` materializes every field as numpy views and takes seconds on a 49k-token
vocabulary).
Chat templates are rendered with jinja2 in a sandbox, with the options transformers uses.
"""

from __future__ import annotations

import datetime
import json
import pathlib
from dataclasses import dataclass, field
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as BackendTokenizer

from conveyor.gguf_tokenizer import (  # noqa: F401 - re-exported: the engine's names for these
    TokenizerError,
    byte_level_backend,
    pre_tokenizer as _pre_tokenizer,
    read_gguf_metadata,
)


def _special_content(value: Any) -> str | None:
    """tokenizer_config.json writes a special token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def tokenizer_source(path: str | pathlib.Path) -> pathlib.Path:
    """The .gguf file or the directory holding tokenizer.json that `path` names; TokenizerError otherwise.
    Cheap (no file is read), so `conveyor serve` checks it before the engine loads the model."""
    path = pathlib.Path(path).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return path
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return path
    if path.name == "tokenizer.json" and path.is_file():
        return path.parent
    raise TokenizerError(f"no tokenizer at {str(path)!r}: expected a .gguf file or a tokenizer.json (--tokenizer)")


@dataclass
class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special ids and chat template the engine needs."""

    backend: BackendTokenizer
    """The fast tokenizer doing the work."""
    bos_token_id: int | None
    """Beginning-of-sequence id (None if the model has none)."""
    eos_token_id: int | None
    """End-of-sequence id generation stops at."""
    pad_token_id: int | None = None
    """Padding id, if any (unused by the engine, reported for completeness)."""
    add_bos_token: bool = False
    """`encode(add_special_tokens=True)` prepends BOS."""
    chat_template: str | None = None
    """Jinja2 chat template (None: the model has none; apply_chat_template then raises)."""
    _compiled_template: jinja2.Template | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.chat_template is not None:
            self._compiled_template = _compile_template(self.chat_template)

    @classmethod
    def from_path(cls, path: str | pathlib.Path) -> Tokenizer:
        """From a .gguf file, a tokenizer.json file, or a directory holding tokenizer.json."""
        source = tokenizer_source(path)
        return cls.from_gguf(source) if source.suffix == ".gguf" else cls.from_directory(source)

    @classmethod
    def from_gguf(cls, path: str | pathlib.Path) -> Tokenizer:
        """Rebuild the tokenizer a GGUF describes (byte-level BPE only)."""
        metadata = read_gguf_metadata(path)
        kind = metadata.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise TokenizerError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2')")
        return cls(
            backend=byte_level_backend(metadata),
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=metadata.get("tokenizer.ggml.eos_token_id"),
            pad_token_id=metadata.get("tokenizer.ggml.padding_token_id"),
            add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=metadata.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_directory(cls, directory: str | pathlib.Path) -> Tokenizer:
        """tokenizer.json plus, if present, tokenizer_config.json (special tokens, chat template)."""
        directory = pathlib.Path(directory)
        backend = BackendTokenizer.from_file(str(directory / "tokenizer.json"))
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)

        def token_id(key: str) -> int | None:
            content = _special_content(config.get(key))
            return None if content is None else backend.token_to_id(content)

        return cls(
            backend=backend,
            bos_token_id=token_id("bos_token"),
            eos_token_id=token_id("eos_token"),
            pad_token_id=token_id("pad_token"),
            add_bos_token=bool(config.get("add_bos_token", False)),
            chat_template=template,
        )

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(i for i, token in self.backend.get_added_tokens_decoder().items() if token.special)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The batch entry points release the GIL while they work (`encode` holds it: a 4 MB prompt on
        # a worker thread would still freeze the event loop for seconds); `_fast` skips offsets.
        batch = getattr(self.backend, "encode_batch_fast", None) or self.backend.encode_batch  # _fast: tokenizers>=0.21
        ids = batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            return [self.bos_token_id, *ids]
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of token_ids; special tokens are dropped unless skip_special_tokens is False (vLLM's default)."""
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        """Token strings in the vocabulary's spelling (byte-level: GPT-2 alphabet)."""
        return [self.backend.id_to_token(i) or "" for i in ids]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        """Inverse of convert_ids_to_tokens (may end in U+FFFD when a UTF-8 character is incomplete)."""
        return self.backend.decoder.decode(tokens)

    def token_text(self, token_id: int) -> str | None:
        """The text of one token as the decoder renders it (for logprobs)."""
        token = self.backend.id_to_token(token_id)
        return None if token is None else self.convert_tokens_to_string([token])

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render `messages` with the model's chat template (as transformers does, to text)."""
        if self._compiled_template is None:
            raise TokenizerError("this model has no chat template; send a completion (prompt) request instead")
        special = {
            "bos_token": self.token_text(self.bos_token_id) if self.bos_token_id is not None else "",
            "eos_token": self.token_text(self.eos_token_id) if self.eos_token_id is not None else "",
        }
        return self._compiled_template.render(messages=messages, add_generation_prompt=add_generation_prompt, **special, **extra)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """Templates' `tojson` as transformers defines it (jinja's own escapes HTML characters)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _compile_template(source: str) -> jinja2.Template:
    """A sandboxed template with the options and helpers transformers gives chat templates."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)
