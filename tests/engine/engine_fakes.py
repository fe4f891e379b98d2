"""Test doubles for the engine: a byte-level tokenizer (each token is raw bytes, like byte-level BPE)."""

from __future__ import annotations

SPECIAL_EOS = 0


class ByteTokenizer:
    """Token id = byte value + 1 for single bytes; extra multi-byte tokens from `merges`; 0 is EOS."""

    def __init__(self, merges: list[bytes] | None = None) -> None:
        self.pieces: list[bytes] = [b"<eos>"] + [bytes([b]) for b in range(256)] + list(merges or [])
        self.eos_token_id = SPECIAL_EOS

    def token_id(self, piece: bytes) -> int:
        return self.pieces.index(piece)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b + 1 for b in text.encode("utf-8")]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        parts = [self.pieces[t] for t in token_ids if not (skip_special_tokens and t == SPECIAL_EOS)]
        return b"".join(parts).decode("utf-8", errors="replace")

    def ids_for(self, chunks: list[bytes]) -> list[int]:
        """Token ids for explicit byte chunks (each chunk must be a single byte or a merge)."""
        return [self.token_id(c) for c in chunks]
