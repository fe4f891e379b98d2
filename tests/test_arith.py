"""conveyor.arith: the one ceiling division."""

from __future__ import annotations

from conveyor.arith import cdiv


def test_cdiv_rounds_up_and_is_exact_on_large_ints() -> None:
    assert [cdiv(n, 4) for n in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]
    assert cdiv(10**30 + 1, 10**15) == 10**15 + 1  # no float round trip
