"""Chained hashes of full KV blocks: the keys of the prefix cache.

Model: block i of a request (tokens [i*block_size, (i+1)*block_size)) is identified by
hash(i) = SHA-256(hash(i-1) || extra keys || token ids of block i). Chaining makes a hash stand for the
whole prefix up to and including its block, so a lookup can walk a request's hashes and stop at the
first miss. The extra key is the request's `cache_salt`, mixed into block 0 only: the chain carries it
into every later block, so requests with different salts never share a block. Only full blocks are
hashed (a partial block's KV is still being written). Hashes are computed incrementally, once per block,
when a request's tokens fill it (`extend_block_hashes`): never O(total tokens) per step.

SHA-256 rather than Python's `hash()`: a collision would silently serve another prompt's KV, and SHA-256
is also stable across processes and Python versions. It costs ~1 us per block, paid once per block.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from conveyor.request import Request

_DIGEST_BYTES = 32


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int], cache_salt: str | None) -> int:
    """The chained hash of one full block (parent_hash is None for block 0)."""
    hasher = hashlib.sha256()
    if parent_hash is not None:
        hasher.update(parent_hash.to_bytes(_DIGEST_BYTES, "big"))
    if cache_salt is None:
        hasher.update(b"\x00")
    else:
        salt = cache_salt.encode("utf-8")
        hasher.update(b"\x01" + len(salt).to_bytes(8, "big") + salt)
    hasher.update(array("q", token_ids).tobytes())
    return int.from_bytes(hasher.digest(), "big")


def token_slice(request: Request, start: int, end: int) -> list[int]:
    """request.all_token_ids[start:end] without concatenating prompt and output."""
    num_prompt = len(request.prompt_token_ids)
    if end <= num_prompt:
        return request.prompt_token_ids[start:end]
    if start >= num_prompt:
        return request.output_token_ids[start - num_prompt:end - num_prompt]
    return request.prompt_token_ids[start:] + request.output_token_ids[:end - num_prompt]


def extend_block_hashes(request: Request, block_size: int) -> None:
    """Append the hashes of the request's blocks that became full since the last call."""
    hashes = request.block_hashes
    num_full_blocks = request.num_tokens // block_size
    while len(hashes) < num_full_blocks:
        index = len(hashes)
        tokens = token_slice(request, index * block_size, (index + 1) * block_size)
        if index == 0:
            hashes.append(hash_block_tokens(None, tokens, request.cache_salt))
        else:
            hashes.append(hash_block_tokens(hashes[-1], tokens, None))
