from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

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


def _chain(tokens: list[int], block_size: int, salt: str | None) -> list[int]:
    request = make_request(prompt=tokens, cache_salt=salt)
    extend_block_hashes(request, block_size)
    return request.block_hashes


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**31), min_size=4, max_size=40), block_size=st.sampled_from([1, 2, 4]),
       salts=st.lists(st.text(min_size=1, max_size=8), min_size=2, max_size=2, unique=True))
def test_salt_enters_the_first_block_only(tokens: list[int], block_size: int, salts: list[str]) -> None:
    """vLLM's rule: the salt is an extra key of block 0 alone; later blocks chain plain token hashes, so
    a salt changes every block's hash (no two salts share a block) only through the chain."""
    plain = _chain(tokens, block_size, None)
    for salt in salts:
        salted = _chain(tokens, block_size, salt)
        assert salted == _chain(tokens, block_size, salt)  # same salt: same keys (shared as before)
        assert salted[0] == hash_block_tokens(None, tokens[:block_size], salt)
        for index in range(1, len(salted)):
            block = tokens[index * block_size:(index + 1) * block_size]
            assert salted[index] == hash_block_tokens(salted[index - 1], block, None)
        assert not set(salted) & set(plain)
    assert not set(_chain(tokens, block_size, salts[0])) & set(_chain(tokens, block_size, salts[1]))
