"""A GGUF file's tokenizer as a `tokenizers.Tokenizer`: llama.cpp stores no tokenizer.json, only metadata.

llama.cpp keeps the vocabulary, the BPE merges, a type per token (1 normal, 3 control, 4 user-defined),
the special ids, a pre-tokenizer name and the chat template as GGUF metadata. For byte-level BPE
(`tokenizer.ggml.model == "gpt2"`) the `tokenizers` pipeline is rebuilt: GPT-2 byte-to-unicode
alphabet, BPE over the merges, control tokens as special added tokens (matched whole, never split), and
the pre-tokenizer the name implies (the StarCoder family, SmolLM included, splits digits one by one
before the GPT-2 regex, as llama.cpp does; Llama 3 and Qwen2 use their published split regexes; unknown
names are refused). Shared by the engine's tokenizer and the benchmark's exact-length readers
(`conveyor trace import --tokenizer`), which sit in layers that may not import each other.
"""

from __future__ import annotations

import pathlib
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer as BackendTokenizer, decoders, models, pre_tokenizers

from conveyor import gguf_header


class TokenizerError(ValueError):
    """The tokenizer source is missing or not one we can build."""


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


def byte_level_backend(metadata: dict[str, Any]) -> BackendTokenizer:
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
    backend.pre_tokenizer = pre_tokenizer(metadata.get("tokenizer.ggml.pre", "default"))
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


def pre_tokenizer(name: str) -> pre_tokenizers.PreTokenizer:
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
