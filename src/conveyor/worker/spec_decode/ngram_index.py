"""The n-gram proposer's memory of each live request: its tokens in one matrix, and the n-grams it has seen.

The model: row r of `matrix` [rows, width] int32 holds a request's tokens (`ABSENT_TOKEN` beyond them);
row r of `seen` [rows, num_buckets / 8] uint8 is a bitset of the hashes of its min_n-grams that end
before its last token -- each one a possible match end, with a token after it to draft. A lookup
succeeds only if the request's last min_n tokens occurred there (a longer matching suffix contains a
matching min_n one), so a clear bit for that suffix proves the request gets no draft without reading
its row; a set bit may be a hash collision, and the exact lookup (ngram_proposer.py) reads the row.
Both are kept up to date by appends: a step writes each request's new tokens and the n-grams they
complete, for the whole batch in a few numpy operations, so it costs O(batch + new tokens), not the
O(batch x history) of scanning every row. Only appends are expected (the worker's confirmed tokens); a
request whose tokens shrank is copied again from scratch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from operator import itemgetter

import numpy as np

ABSENT_TOKEN = -1
"""The matrix's filler beyond each row's tokens: no token id is negative, so it never matches one."""

DEFAULT_NUM_BUCKETS = 1 << 17
"""Hash buckets per request (16 KiB of bits): at L tokens about L / 2^17 of the draft-less requests
still get the exact lookup (0.5% at 600 tokens, 6% at 8k)."""

_MIX = np.uint64(0x9E3779B97F4A7C15)  # odd 64-bit constants (golden ratio, splitmix64's)
_MIX_2 = np.uint64(0xBF58476D1CE4E5B9)
_BITS = np.left_shift(1, np.arange(8)).astype(np.uint8)  # bit i of a byte


class NgramIndex:
    """Token rows and seen-n-gram bitsets of the live requests (see the module docstring); rows are
    reused after `drop`, and the arrays double when outgrown."""

    def __init__(self, min_n: int, num_rows: int = 16, width: int = 256,
                 num_buckets: int = DEFAULT_NUM_BUCKETS) -> None:
        if num_buckets < 8 or num_buckets & (num_buckets - 1):
            raise ValueError(f"num_buckets must be a power of two >= 8 (got {num_buckets})")
        self.min_n = min_n
        self._bucket_shift = np.uint64(64 - (num_buckets.bit_length() - 1))  # a hash's top bits pick its bucket
        # Offsets back from a row's last token of the tokens of its last two n-grams: [2, n].
        self._pair_backs = np.arange(min_n) + np.arange(2)[:, None]
        self.matrix = np.full((num_rows, width), ABSENT_TOKEN, dtype=np.int32)
        self.seen = np.zeros((num_rows, num_buckets // 8), dtype=np.uint8)
        self.num_synced = np.zeros(num_rows, dtype=np.int64)
        """[rows] tokens of each row copied so far."""
        self._row_of: dict[str, int] = {}
        self._free_rows = list(range(num_rows - 1, -1, -1))

    def sync(self, request_id: str, token_ids: Sequence[int]) -> int:
        """`sync_many` of one request; returns its row."""
        return int(self.sync_many([request_id], [token_ids])[0][0])

    def sync_many(self, request_ids: Sequence[str], token_ids: Sequence[Sequence[int]]
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Copy each request's tokens appended since its last sync (all of them for a new request, or
        one whose tokens shrank) and record the n-grams they complete. Returns (rows, lengths) [B]
        int64 and may_match [B] bool: whether the request's last min_n tokens may have occurred earlier
        with a token after them (False is certain; True may be a collision). The usual step -- known
        requests longer than min_n, one new token each -- reads each request's row, length and last
        token in three passes and does the rest in about thirty numpy operations over the batch."""
        rows = self._rows(request_ids)
        lengths = np.fromiter(map(len, token_ids), dtype=np.int64, count=len(token_ids))
        done = self.num_synced[rows]
        if (lengths.size and (lengths - done == 1).all() and int(lengths.min()) > self.min_n
                and int(lengths.max()) <= self.matrix.shape[1]):
            self.num_synced[rows] = lengths
            self.matrix[rows, done] = np.fromiter(map(itemgetter(-1), token_ids), dtype=np.int32, count=len(rows))
            return rows, lengths, self._record_last_ngrams(rows, lengths)
        return rows, lengths, self._sync_any(rows, lengths, done, token_ids)

    def drop(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            row = self._row_of.pop(request_id, None)
            if row is not None:
                self._clear_row(row)
                self._free_rows.append(row)

    def _rows(self, request_ids: Sequence[str]) -> np.ndarray:
        """[B] int64 row of each request, new ones given a free row."""
        try:
            return np.fromiter(map(self._row_of.__getitem__, request_ids), dtype=np.int64, count=len(request_ids))
        except KeyError:  # some are new
            row_of = self._row_of
            return np.array([row_of[request_id] if request_id in row_of else self._new_row(request_id)
                             for request_id in request_ids], dtype=np.int64)

    def _sync_any(self, rows: np.ndarray, lengths: np.ndarray, done: np.ndarray,
                  token_ids: Sequence[Sequence[int]]) -> np.ndarray:
        """`sync_many` of any batch (new rows, shrunk ones, several tokens, growth); returns may_match."""
        for i in np.flatnonzero(lengths < done).tolist():  # not an append: start the row again
            self._clear_row(int(rows[i]))
            done[i] = 0
        if lengths.size and int(lengths.max()) > self.matrix.shape[1]:
            self._grow(self.matrix.shape[0], max(2 * self.matrix.shape[1], int(lengths.max())))
        self.num_synced[rows] = lengths
        more = np.flatnonzero(lengths > done)
        if more.size:  # matrix[rows[i], done[i]:lengths[i]] = token_ids[i][done[i]:]
            values = [t for i, a in zip(more.tolist(), done[more].tolist()) for t in token_ids[i][a:]]
            flat_rows, columns = _ranges(rows[more], done[more], lengths[more])
            self.matrix[flat_rows, columns] = values
        self._record_ngrams(rows, done, lengths)
        # A match ends at min_n - 1 at the earliest and before the last token: only longer rows can match.
        may_match = lengths > self.min_n
        long_rows = rows[may_match]
        may_match[may_match] = self._is_set(long_rows, self._buckets(long_rows, lengths[may_match] - 1))
        return may_match

    def _record_last_ngrams(self, rows: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """After one new token per row (every row longer than min_n): set the bit of the n-gram that now
        has a token after it (ending at lengths - 2), then return whether the suffix's bit (ending at
        lengths - 1) is set. One gather and one hash cover both n-grams; the rows are distinct, so a
        plain fancy-indexed OR sets every bit."""
        last = rows * self.matrix.shape[1] + lengths - 1  # [B] flat index of each row's last token
        grams = self.matrix.reshape(-1)[last[:, None, None] - self._pair_backs]  # [B, 2, n]
        buckets = self._hash(grams)  # [B, 2]: (suffix, previous suffix)
        recorded, suffix = buckets[:, 1], buckets[:, 0]
        self.seen[rows, recorded >> 3] |= _BITS[recorded & 7]
        return self._is_set(rows, suffix)

    def _record_ngrams(self, rows: np.ndarray, done: np.ndarray, lengths: np.ndarray) -> None:
        """Set the bits of the min_n-grams that now have a token after them: those ending at positions
        max(done - 1, min_n - 1) .. lengths - 2 of each row."""
        first_end = np.maximum(done - 1, self.min_n - 1)
        flat_rows, ends = _ranges(rows, first_end, np.maximum(first_end, lengths - 1))
        if ends.size:
            buckets = self._buckets(flat_rows, ends)
            np.bitwise_or.at(self.seen, (flat_rows, buckets >> 3), _BITS[buckets & 7])

    def _buckets(self, rows: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """[C] int64 bucket of the min_n-gram ending at ends[c] of row rows[c] (all its tokens synced)."""
        index = rows * self.matrix.shape[1] + ends  # [C] flat index of each n-gram's last token
        return self._hash(self.matrix.reshape(-1)[index[:, None] - self._pair_backs[0]])

    def _hash(self, grams: np.ndarray) -> np.ndarray:
        """grams [..., n] int32 (an n-gram's tokens from its last one back) -> buckets [...] int64."""
        keys = grams.astype(np.uint64)
        key = keys[..., 0]
        for back in range(1, self.min_n):
            key = (key * _MIX_2) ^ keys[..., back]
        key = (key ^ (key >> np.uint64(31))) * _MIX  # the high bits depend on every token of the n-gram
        return (key >> self._bucket_shift).view(np.int64)  # < num_buckets: the view reads the same value

    def _is_set(self, rows: np.ndarray, buckets: np.ndarray) -> np.ndarray:
        return (self.seen[rows, buckets >> 3] & _BITS[buckets & 7]) != 0

    def _new_row(self, request_id: str) -> int:
        if not self._free_rows:
            num_rows = self.matrix.shape[0]
            self._grow(2 * num_rows, self.matrix.shape[1])
            self._free_rows = list(range(2 * num_rows - 1, num_rows - 1, -1))
        row = self._free_rows.pop()
        self._row_of[request_id] = row
        return row

    def _clear_row(self, row: int) -> None:
        self.matrix[row, : self.num_synced[row]] = ABSENT_TOKEN
        self.seen[row] = 0
        self.num_synced[row] = 0

    def _grow(self, num_rows: int, width: int) -> None:
        old_rows, old_width = self.matrix.shape
        matrix = np.full((num_rows, width), ABSENT_TOKEN, dtype=np.int32)
        matrix[:old_rows, :old_width] = self.matrix
        seen = np.zeros((num_rows, self.seen.shape[1]), dtype=np.uint8)
        seen[:old_rows] = self.seen
        num_synced = np.zeros(num_rows, dtype=np.int64)
        num_synced[:old_rows] = self.num_synced
        self.matrix, self.seen, self.num_synced = matrix, seen, num_synced


def _ranges(rows: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row, position) of every position starts[i] .. stops[i] - 1 of rows[i], request after request."""
    counts = stops - starts
    flat_rows = np.repeat(rows, counts)
    first_of_range = np.repeat(np.cumsum(counts) - counts, counts)
    return flat_rows, np.arange(flat_rows.shape[0]) - first_of_range + np.repeat(starts, counts)
