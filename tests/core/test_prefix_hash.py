from __future__ import annotations

from conveyor.core.prefix_hash import extend_block_hashes, hash_block_tokens, token_slice
from core_builders import make_request


def test_hash_is_chained_and_deterministic() -> None:
    first = hash_block_tokens(None, [1, 2, 3, 4], None)
    assert first == hash_block_tokens(None, [1, 2, 3, 4], None)
    assert hash_block_tokens(first, [5, 6, 7, 8], None) != hash_block_tokens(None, [5, 6, 7, 8], None)
    assert hash_block_tokens(None, [1, 2, 3, 5], None) != first


def test_salt_separates_namespaces() -> None:
    plain = hash_block_tokens(None, [1, 2], None)
    assert hash_block_tokens(None, [1, 2], "tenant-a") != plain
    assert hash_block_tokens(None, [1, 2], "tenant-a") != hash_block_tokens(None, [1, 2], "tenant-b")
    assert hash_block_tokens(None, [1, 2], "") != plain


def test_only_full_blocks_are_hashed_incrementally() -> None:
    request = make_request(num_prompt_tokens=10)
    extend_block_hashes(request, 4)
    assert len(request.block_hashes) == 2
    before = list(request.block_hashes)
    request.output_token_ids.extend([1, 2])
    extend_block_hashes(request, 4)
    assert request.block_hashes[:2] == before and len(request.block_hashes) == 3
    whole = make_request(prompt=request.all_token_ids)
    extend_block_hashes(whole, 4)
    assert whole.block_hashes == request.block_hashes  # across the prompt/output boundary too


def test_token_slice_spans_prompt_and_output() -> None:
    request = make_request(prompt=[1, 2, 3])
    request.output_token_ids.extend([4, 5])
    assert token_slice(request, 0, 2) == [1, 2]
    assert token_slice(request, 2, 4) == [3, 4]
    assert token_slice(request, 3, 5) == [4, 5]
