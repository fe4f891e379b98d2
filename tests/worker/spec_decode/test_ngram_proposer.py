"""N-gram prompt lookup on crafted sequences, and the vectorized batch against the plain reference."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import conveyor.worker.spec_decode.ngram_proposer as ngram_module
from conveyor.worker.spec_decode.ngram_index import NgramIndex
from conveyor.worker.spec_decode.ngram_proposer import NgramParams, NgramProposer, propose_ngram_ref


def params(min_n: int = 2, max_n: int = 3, k: int = 3, max_model_len: int = 1000) -> NgramParams:
    return NgramParams(min_n=min_n, max_n=max_n, num_speculative_tokens=k, max_model_len=max_model_len)


def propose_all(proposer: NgramProposer, request_ids: list[str], histories: list[list[int]]) -> list[list[int]]:
    """propose_tokens as one list per request ([] where it proposes nothing)."""
    drafts = proposer.propose_tokens(request_ids, histories)
    assert all(drafts.values()) and set(drafts) <= set(request_ids)  # only requests with drafts appear
    return [drafts.get(request_id, []) for request_id in request_ids]


def propose_one(tokens: list[int], p: NgramParams) -> list[int]:
    drafts = propose_all(NgramProposer(p), ["r"], [tokens])[0]
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
        assert propose_all(proposer, ids, [histories[i] for i in ids]) == [propose_ngram_ref(histories[i], p) for i in ids]
        for tokens in histories.values():
            tokens.extend(rng.randrange(vocab) for _ in range(rng.randint(1, 4)))


def test_index_reuses_rows_and_grows() -> None:
    index = NgramIndex(min_n=2, num_rows=1, width=2)
    first = index.sync("a", [1, 2, 3])
    second = index.sync("b", [4])
    assert first != second and index.matrix.shape[1] >= 3
    index.drop(["a"])
    assert index.sync("c", [7, 8]) == first
    np.testing.assert_array_equal(index.matrix[first, :3], [7, 8, -1])  # a's third token is gone
    index.sync("b", [4, 5, 6])
    np.testing.assert_array_equal(index.matrix[second, :3], [4, 5, 6])


def _seen_from_scratch(min_n: int, num_buckets: int, histories: dict[str, list[int]]) -> dict[str, np.ndarray]:
    """Each request's bitset as one sync of its whole history into a fresh index computes it."""
    fresh = NgramIndex(min_n, num_buckets=num_buckets)
    return {request_id: fresh.seen[fresh.sync(request_id, tokens)].copy() for request_id, tokens in histories.items()}


def _sync_and_check(index: NgramIndex, histories: dict[str, list[int]]) -> None:
    """Sync every history; each row then holds its history and the bitset of its whole history."""
    ids = sorted(histories)
    rows, lengths, _ = index.sync_many(ids, [histories[i] for i in ids])
    assert lengths.tolist() == [len(histories[i]) for i in ids]
    expected = _seen_from_scratch(index.min_n, 8 * index.seen.shape[1], histories)
    for request_id, row in zip(ids, rows.tolist()):
        np.testing.assert_array_equal(index.seen[row], expected[request_id])
        np.testing.assert_array_equal(index.matrix[row, : len(histories[request_id])], histories[request_id])


@settings(max_examples=60, deadline=None)
@given(data=st.data(), min_n=st.sampled_from([1, 2, 3]), num_buckets=st.sampled_from([8, 64, 1 << 17]))
def test_incremental_bits_equal_the_bits_of_the_whole_history(data: st.DataObject, min_n: int,
                                                              num_buckets: int) -> None:
    """Decode steps (one token each), appends of several tokens, shrinks, drops and reused rows, growth:
    each row's bitset is that of its whole history (the n-grams with a token after them)."""
    index = NgramIndex(min_n, num_rows=2, width=4, num_buckets=num_buckets)
    histories: dict[str, list[int]] = {}
    tokens = st.lists(st.integers(0, 6), min_size=1, max_size=5)
    for step in range(6):
        if histories and data.draw(st.booleans()):  # a decode step: one token each (the batched path)
            for request_id in histories:
                histories[request_id] = histories[request_id] + [data.draw(st.integers(0, 6))]
            _sync_and_check(index, histories)
        for request_id in data.draw(st.lists(st.sampled_from("abcd"), min_size=1, max_size=4, unique=True)):
            old = histories.get(request_id)
            if old is None:
                histories[request_id] = data.draw(tokens)
            elif len(old) > 1 and data.draw(st.booleans()):  # shrunk (not an append): copied again
                histories[request_id] = data.draw(st.lists(st.integers(0, 6), min_size=1, max_size=len(old) - 1))
            else:
                histories[request_id] = old + data.draw(tokens)
        _sync_and_check(index, histories)
        if step == 2:
            dropped = data.draw(st.sampled_from(sorted(histories)))
            index.drop([dropped])
            del histories[dropped]


def test_may_match_is_certain_when_false() -> None:
    index = NgramIndex(min_n=2)
    histories = [[5, 6, 7, 5, 6], [1, 2, 3, 4, 5], [5, 6]]
    assert index.sync_many(["repeat", "fresh", "short"], histories)[2].tolist() == [True, False, False]
    for tokens in histories:  # one token each: the batched path
        tokens.append(7)
    assert index.sync_many(["repeat", "fresh", "short"], histories)[2].tolist() == [True, False, False]
    histories[1] += [4, 5, 9]  # several tokens at once: the general path; (4, 5) repeats, (5, 9) is new
    assert index.sync_many(["fresh"], histories[1:2])[2].tolist() == [False]
    histories[1] += [4, 5]  # (4, 5) again: seen before, with a token after it
    assert index.sync_many(["fresh"], histories[1:2])[2].tolist() == [True]


def test_a_decode_step_takes_the_batched_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Known requests longer than min_n, one new token each: no call of the general sync."""
    index = NgramIndex(min_n=2)
    histories = [[1, 2, 3, 4], [5, 6, 7, 8, 9], [1, 2, 3]]
    index.sync_many(["a", "b", "c"], histories)
    monkeypatch.setattr(index, "_sync_any", lambda *args: pytest.fail("a decode step took the general path"))
    for tokens, token in zip(histories, [1, 7, 9]):
        tokens.append(token)
    assert index.sync_many(["a", "b", "c"], histories)[2].tolist() == [False, False, False]
    for tokens, token in zip(histories, [2, 8, 1]):  # (1, 2) and (7, 8) seen before, (9, 1) not
        tokens.append(token)
    assert index.sync_many(["a", "b", "c"], histories)[2].tolist() == [True, True, False]


def test_only_requests_whose_last_ngram_was_seen_are_looked_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """Random ids: the exact lookup reads the rows of the few requests that repeated their last bigram."""
    looked_up: list[int] = []
    real = ngram_module.propose_ngram_drafts

    def spy(matrix: np.ndarray, rows: np.ndarray, lengths: np.ndarray, p: NgramParams) -> list[list[int]]:
        looked_up.append(len(rows))
        return real(matrix, rows, lengths, p)

    monkeypatch.setattr(ngram_module, "propose_ngram_drafts", spy)
    rng = random.Random(0)
    p = params(min_n=2, max_n=5)
    histories = [[rng.randrange(10000) for _ in range(600)] for _ in range(64)]
    histories[3] += histories[3][100:102]  # a repeated bigram: drafts
    proposer = NgramProposer(p)
    drafts = propose_all(proposer, [f"r{i}" for i in range(64)], histories)
    assert drafts == [propose_ngram_ref(h, p) for h in histories] and drafts[3] == histories[3][102:105]
    assert 1 <= sum(looked_up) <= 4  # r3, and a collision or a chance repeat at most now and then


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
    # small: new rows and growth happen mid-batch, and 8 buckets make most draft-less rows collide
    proposer.index = NgramIndex(p.min_n, num_rows=2, width=8, num_buckets=8)
    histories = dict(enumerate(data.draw(_histories(vocab, phrase))))
    for step in range(4):
        ids = sorted(histories)
        drafts = propose_all(proposer, [f"r{i}" for i in ids], [histories[i] for i in ids])
        assert drafts == [propose_ngram_ref(histories[i], p) for i in ids]
        for i in ids:  # append the drafts (all accepted) or a few new ids, like a verified step
            extra = drafts[ids.index(i)] or data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=4))
            histories[i] = histories[i] + extra
        if step == 1 and len(ids) > 1:
            dropped = data.draw(st.sampled_from(ids))
            proposer.drop([f"r{dropped}"])
            histories[dropped] = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=30))
