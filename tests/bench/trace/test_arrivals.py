"""Arrival processes match their rate and burstiness (gap CV = 1/sqrt(k)), as vLLM defines them."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.bench.trace.arrivals import ArrivalConfig, ArrivalProcess, send_offsets_s

N = 20_000


@settings(max_examples=25, deadline=None, derandomize=True)  # reproducible in CI
@given(rate=st.floats(0.5, 2000.0), k=st.floats(0.25, 8.0), seed=st.integers(0, 2**31))
def test_gamma_matches_rate_and_cv(rate: float, k: float, seed: int) -> None:
    offsets = send_offsets_s(ArrivalConfig(ArrivalProcess.GAMMA, rate, k, seed=seed), N)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and np.all(gaps >= 0)
    assert abs(np.mean(gaps) * rate - 1.0) < 0.05
    assert abs(np.std(gaps) / np.mean(gaps) - 1.0 / math.sqrt(k)) < 0.07 / math.sqrt(k)


def test_poisson_ignores_burstiness_and_is_seeded() -> None:
    a = send_offsets_s(ArrivalConfig(ArrivalProcess.POISSON, 10.0, burstiness=0.1, seed=7), N)
    gaps = np.diff(a)
    assert abs(np.std(gaps) / np.mean(gaps) - 1.0) < 0.05
    assert a == send_offsets_s(ArrivalConfig(ArrivalProcess.POISSON, 10.0, seed=7), N)
    assert a != send_offsets_s(ArrivalConfig(ArrivalProcess.POISSON, 10.0, seed=8), N)


def test_constant_inf_and_replay() -> None:
    assert send_offsets_s(ArrivalConfig(ArrivalProcess.CONSTANT, 4.0), 3) == [0.0, 0.25, 0.5]
    assert send_offsets_s(ArrivalConfig(ArrivalProcess.POISSON, math.inf), 3) == [0.0, 0.0, 0.0]
    replay = ArrivalConfig(ArrivalProcess.REPLAY, time_scale=2.0)
    assert send_offsets_s(replay, 3, [10.0, 11.0, 14.0]) == [0.0, 0.5, 2.0]
    with pytest.raises(ValueError, match="replay needs an arrival_s"):
        send_offsets_s(replay, 2, [1.0, None])
    with pytest.raises(ValueError, match="request_rate"):
        ArrivalConfig(request_rate=0.0)
