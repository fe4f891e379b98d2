from __future__ import annotations

import dataclasses

import pytest

from conveyor.core.fast_outputs import cached_request_data, token_output
from conveyor.core.outputs import CachedRequestData, EngineCoreOutput


def test_fast_constructors_match_the_dataclasses() -> None:
    fast, slow = token_output("a", [1, 2], []), EngineCoreOutput("a", [1, 2], [])
    assert fast == slow and vars(fast) == vars(slow)
    assert {f.name for f in dataclasses.fields(EngineCoreOutput)} == set(vars(fast))
    fast_data, slow_data = cached_request_data("a", [3], 7), CachedRequestData("a", [3], 7)
    assert fast_data == slow_data and vars(fast_data) == vars(slow_data)
    assert {f.name for f in dataclasses.fields(CachedRequestData)} == set(vars(fast_data))


def test_fast_outputs_stay_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        token_output("a", [], []).request_id = "b"  # type: ignore[misc]
