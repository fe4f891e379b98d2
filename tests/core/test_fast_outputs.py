from __future__ import annotations

import dataclasses

import pytest

from conveyor.core.fast_outputs import token_output
from conveyor.core.outputs import EngineCoreOutput


def test_fast_constructor_matches_the_dataclasses() -> None:
    fast, slow = token_output("a", [1, 2], []), EngineCoreOutput("a", [1, 2], [])
    assert fast == slow and vars(fast) == vars(slow)
    assert {f.name for f in dataclasses.fields(EngineCoreOutput)} == set(vars(fast))


def test_fast_outputs_stay_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        token_output("a", [], []).request_id = "b"  # type: ignore[misc]
