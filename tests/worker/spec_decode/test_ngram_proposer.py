"""N-gram prompt lookup on crafted sequences, and the vectorized batch against the plain reference."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.worker.spec_decode.ngram_proposer import NgramParams, NgramProposer, TokenRows, propose_ngram_ref


def params(min_n: int = 2, max_n: int = 3, k: int = 3, max_model_len: int = 1000) -> NgramParams:
    return NgramParams(min_n=min_n, max_n=max_n, num_speculative_tokens=k, max_model_len=max_model_len)


def propose_one(tokens: list[int], p: NgramParams) -> list[int]:
    drafts = NgramProposer(p).propose_tokens(["r"], [tokens])[0]
    assert drafts == propose_ngram_ref(tokens, p)
    return drafts


def test_a_repeat_proposes_what_followed_it() -> None:
    assert propose_one([1, 2, 3, 4, 5, 9, 9, 1, 2, 3], params()) == [4, 5, 9]


def test_the_longest_suffix_wins_over_a_later_shorter_match() -> None:
    # suffix (7, 8, 9): "7 8 9" matched at the start (length 3) beats the later "8 9" (length 2)
    tokens = [7, 8, 9, 1, 1, 1, 5, 8, 9, 2, 2, 2, 7, 8, 9]
    assert propose_one(tokens, params(min_n=2, max_n=3)) == [1, 1, 1]


def test_among_equally_long_matches_the_latest_wins() -> None:
    tokens = [4, 5, 10, 11, 12, 4, 5, 20, 21, 22, 4, 5]
    assert propose_one(tokens, params(min_n=2, max_n=2)) == [20, 21, 22]


def test_min_n_is_respected() -> None:
    tokens = [3, 4, 50, 51, 52, 9, 4]  # only a 1-token match ("4")
    assert propose_one(tokens, params(min_n=2, max_n=3)) == []
    assert propose_one(tokens, params(min_n=1, max_n=3)) == [50, 51, 52]


def test_max_n_caps_the_window() -> None:
    # suffix 1 2 3 4 matches at length 4 early, and 3 4 later; with max_n = 2 only the later one counts
    tokens = [1, 2, 3, 4, 60, 61, 62, 0, 3, 4, 70, 71, 72, 1, 2, 3, 4]
    assert propose_one(tokens, params(min_n=2, max_n=4)) == [60, 61, 62]
    assert propose_one(tokens, params(min_n=2, max_n=2)) == [70, 71, 72]


def test_no_match_no_drafts_and_short_requests() -> None:
    assert propose_one(list(range(20)), params()) == []
    assert propose_one([5], params(min_n=1, max_n=1)) == []
    assert propose_one([5, 5], params(min_n=1, max_n=1)) == [5]


def test_drafts_stop_at_the_end_of_the_tokens_and_at_max_model_len() -> None:
    tokens = [1, 2, 3, 8, 1, 2, 3]  # the match is followed by 8 and then the suffix itself
    assert propose_one(tokens, params(k=5)) == [8, 1, 2, 3]
    assert propose_one(tokens, params(k=5, max_model_len=9)) == [8, 1]
    assert propose_one(tokens, params(k=5, max_model_len=7)) == []


def test_overlapping_repeats() -> None:
    assert propose_one([6, 6, 6, 6, 6], params(min_n=2, max_n=3, k=4)) == [6]  # latest: ends at position 3


@pytest.mark.parametrize("vocab", [3, 8, 50])
def test_batch_matches_the_reference_on_random_sequences(vocab: int) -> None:
    rng = random.Random(vocab)
    p = params(min_n=1, max_n=4, k=5, max_model_len=300)
    proposer = NgramProposer(p)
    histories = {f"r{i}": [rng.randrange(vocab) for _ in range(rng.randint(1, 200))] for i in range(40)}
    for _ in range(3):  # the rows are synced by appends, step after step
        ids = list(histories)
        assert proposer.propose_tokens(ids, [histories[i] for i in ids]) == [propose_ngram_ref(histories[i], p) for i in ids]
        for tokens in histories.values():
            tokens.extend(rng.randrange(vocab) for _ in range(rng.randint(1, 4)))


def test_token_rows_reuse_rows_and_grow() -> None:
    rows = TokenRows(num_rows=1, width=2)
    first = rows.sync("a", [1, 2, 3])
    second = rows.sync("b", [4])
    assert first != second and rows.matrix.shape[1] >= 3
    rows.drop(["a"])
    assert rows.sync("c", [7, 8]) == first
    np.testing.assert_array_equal(rows.matrix[first, :2], [7, 8])
    rows.sync("b", [4, 5, 6])
    np.testing.assert_array_equal(rows.matrix[second, :3], [4, 5, 6])


def _histories(vocab: int, phrase: int) -> st.SearchStrategy[list[list[int]]]:
    """Random ids, or (phrase > 0) a random phrase repeated with random edits: drafts are common."""
    if phrase == 0:
        return st.lists(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=60), min_size=1, max_size=8)
    base = st.lists(st.integers(0, vocab - 1), min_size=phrase, max_size=phrase)
    one = st.tuples(base, st.integers(1, 8), st.lists(st.integers(0, vocab - 1), max_size=5)).map(
        lambda t: (t[0] * t[1])[: 60 - len(t[2])] + t[2])
    return st.lists(one, min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), vocab=st.sampled_from([2, 5, 1000]), phrase=st.sampled_from([0, 2, 3, 7]),
       lookup=st.sampled_from([(1, 3), (2, 5), (3, 3)]))
def test_steps_of_appends_and_drops_match_the_reference(data: st.DataObject, vocab: int, phrase: int,
                                                        lookup: tuple[int, int]) -> None:
    """The batched sync (rows reused after drops, the matrix outgrown) proposes what the reference
    proposes from the whole history, step after step."""
    p = params(min_n=lookup[0], max_n=lookup[1], k=3, max_model_len=500)
    proposer = NgramProposer(p)
    proposer.rows = TokenRows(num_rows=2, width=8)  # small: new rows and growth happen mid-batch
    histories = dict(enumerate(data.draw(_histories(vocab, phrase))))
    for step in range(4):
        ids = sorted(histories)
        drafts = proposer.propose_tokens([f"r{i}" for i in ids], [histories[i] for i in ids])
        assert drafts == [propose_ngram_ref(histories[i], p) for i in ids]
        for i in ids:  # append the drafts (all accepted) or a few new ids, like a verified step
            extra = drafts[ids.index(i)] or data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=4))
            histories[i] = histories[i] + extra
        if step == 1 and len(ids) > 1:
            dropped = data.draw(st.sampled_from(ids))
            proposer.drop([f"r{dropped}"])
            histories[dropped] = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=30))
