"""Text <-> token ids, from a `tokenizer.json` or rebuilt from a GGUF file's own vocabulary.

A GGUF carries no tokenizer.json: llama.cpp stores the vocabulary, the BPE merges, a type per
token (1 normal, 3 control, 4 user-defined), the special ids, a pre-tokenizer name and the chat
template as metadata. For byte-level BPE (`tokenizer.ggml.model == "gpt2"`) we rebuild the
`tokenizers` pipeline: GPT-2 byte-to-unicode alphabet, BPE over the merges, control tokens as
special added tokens (matched whole, never split), and the pre-tokenizer the name implies (the
StarCoder family, SmolLM included, splits digits one by one before the GPT-2 regex, as
llama.cpp does; Llama 3 and Qwen2 use their published split regexes; unknown names are refused).
The metadata comes from `conveyor.gguf_header` (a small struct parser: `gguf.GGUFReader`
materializes every field as numpy views and takes seconds on a 49k-token vocabulary).
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
from tokenizers import AddedToken, Regex, Tokenizer as BackendTokenizer, decoders, models, pre_tokenizers

from conveyor import gguf_header

GGUF_TOKEN_TYPE_CONTROL = 3
GGUF_TOKEN_TYPE_USER_DEFINED = 4
# llama.cpp pre-tokenizer names -> how text is split before BPE. "gpt2": GPT-2's regex (ByteLevel's
# own); "digits": StarCoder family, every digit isolated first, then GPT-2's regex; otherwise the
# model family's published split regex (as in its tokenizer.json).
_GPT2_PRE = "gpt2"
_DIGITS_PRE = "digits"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZERS = {
    "default": _GPT2_PRE, "gpt-2": _GPT2_PRE, "gpt2": _GPT2_PRE,
    "smollm": _DIGITS_PRE, "starcoder": _DIGITS_PRE, "refact": _DIGITS_PRE, "codeshell": _DIGITS_PRE,
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}


class TokenizerError(ValueError):
    """The tokenizer source is missing or not one we can build."""


def read_gguf_metadata(path: str | pathlib.Path) -> dict[str, Any]:
    """The key/value metadata of a GGUF file (header only; tensors are not read)."""
    try:
        return gguf_header.read_gguf_metadata(path)
    except gguf_header.GGUFFormatError as error:
        raise TokenizerError(str(error)) from None


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _byte_level_backend(metadata: dict[str, Any]) -> BackendTokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` from GGUF vocab, merges, token types and pre name."""
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    # A token stored as raw text (outside the byte alphabet) is respelled in it, as transformers does.
    vocab = {
        (t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
        for i, t in enumerate(tokens)
    }
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre", "default"))
    backend.decoder = decoders.ByteLevel()
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type", [])
    backend.add_special_tokens([
        AddedToken(t, normalized=False, special=True)
        for t, kind in zip(tokens, token_types) if kind == GGUF_TOKEN_TYPE_CONTROL and set(t) <= alphabet
    ])
    backend.add_tokens([
        AddedToken(t, normalized=False, special=False)
        for t, kind in zip(tokens, token_types) if kind == GGUF_TOKEN_TYPE_USER_DEFINED
    ])
    return backend


def _pre_tokenizer(name: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer a GGUF's `tokenizer.ggml.pre` names; unknown names raise (ids would be wrong)."""
    if name not in _PRE_TOKENIZERS:
        raise TokenizerError(f"GGUF pre-tokenizer {name!r} is not supported; known: {sorted(_PRE_TOKENIZERS)}")
    split = _PRE_TOKENIZERS[name]
    if split == _GPT2_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split == _DIGITS_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _special_content(value: Any) -> str | None:
    """tokenizer_config.json writes a special token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


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
        path = pathlib.Path(path).expanduser()
        if path.suffix == ".gguf" and path.is_file():
            return cls.from_gguf(path)
        if path.is_dir() and (path / "tokenizer.json").is_file():
            return cls.from_directory(path)
        if path.name == "tokenizer.json" and path.is_file():
            return cls.from_directory(path.parent)
        raise TokenizerError(f"no tokenizer at {str(path)!r}: expected a .gguf file or a tokenizer.json (--tokenizer)")

    @classmethod
    def from_gguf(cls, path: str | pathlib.Path) -> Tokenizer:
        """Rebuild the tokenizer a GGUF describes (byte-level BPE only)."""
        metadata = read_gguf_metadata(path)
        kind = metadata.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise TokenizerError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2')")
        return cls(
            backend=_byte_level_backend(metadata),
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
