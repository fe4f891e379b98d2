"""Arrival processes: when each request of a trace is sent, as offsets in seconds from the run start.

The model is vLLM's (`vllm bench serve --request-rate R --burstiness k`): gaps between requests are
Gamma(shape=k, scale=1/(R·k)), so the mean gap is 1/R for every k and the coefficient of variation of
the gaps is 1/sqrt(k). k=1 is a Poisson process, k<1 is burstier, k→∞ tends to a constant rate.
`constant` is the k=∞ limit (gap exactly 1/R); `replay` uses the trace's own timestamps divided by a
time scale (time_scale=2 replays twice as fast). A rate of math.inf sends everything at t=0. The first
request goes at t=0, as vLLM sends its first request immediately. Seeded with a numpy Generator, so a
(config, n) pair always gives the same schedule.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


class ArrivalProcess(str, enum.Enum):
    POISSON = "poisson"
    GAMMA = "gamma"
    CONSTANT = "constant"
    REPLAY = "replay"


@dataclass(frozen=True)
class ArrivalConfig:
    """How request send times are drawn."""

    process: ArrivalProcess = ArrivalProcess.POISSON
    """poisson (gamma with k=1), gamma, constant, or replay of the trace's timestamps."""
    request_rate: float = math.inf
    """Mean offered requests per second; math.inf sends all requests at once (not used by replay)."""
    burstiness: float = 1.0
    """Gamma shape k (gamma only; poisson forces 1): gap CV = 1/sqrt(k)."""
    time_scale: float = 1.0
    """replay only: trace seconds per wall second (2.0 replays twice as fast)."""
    seed: int = 0
    """Seed of the numpy Generator that draws the gaps."""

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (or inf), got {self.request_rate}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"burstiness must be a finite number > 0, got {self.burstiness}")
        if not (self.time_scale > 0 and math.isfinite(self.time_scale)):
            raise ValueError(f"time_scale must be a finite number > 0, got {self.time_scale}")


def gamma_gaps(num_gaps: int, request_rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Inter-arrival gaps in seconds, Gamma(shape=k, scale=1/(rate·k)) as vLLM draws them."""
    if math.isinf(request_rate):
        return np.zeros(num_gaps)
    return rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_gaps)


def send_offsets_s(cfg: ArrivalConfig, num_requests: int,
                   trace_arrivals_s: Sequence[float | None] = ()) -> list[float]:
    """Scheduled send offsets (seconds from start, non-decreasing) for num_requests requests."""
    if num_requests <= 0:
        return []
    if cfg.process is ArrivalProcess.REPLAY:
        return _replay(trace_arrivals_s, num_requests, cfg.time_scale)
    if cfg.process is ArrivalProcess.CONSTANT:
        gap = 0.0 if math.isinf(cfg.request_rate) else 1.0 / cfg.request_rate
        return [i * gap for i in range(num_requests)]
    k = 1.0 if cfg.process is ArrivalProcess.POISSON else cfg.burstiness
    rng = np.random.default_rng(cfg.seed)
    gaps = gamma_gaps(num_requests - 1, cfg.request_rate, k, rng)
    return [0.0] + [float(t) for t in np.cumsum(gaps)]


def _replay(trace_arrivals_s: Sequence[float | None], num_requests: int, time_scale: float) -> list[float]:
    stamps = list(trace_arrivals_s)[:num_requests]
    if len(stamps) < num_requests or any(s is None for s in stamps):
        raise ValueError("--arrival replay needs an arrival_s timestamp on every request of the trace "
                         "(make the trace with --rate, or import a log with timestamps)")
    values = [float(s) for s in stamps if s is not None]
    if any(b < a for a, b in zip(values, values[1:])):
        raise ValueError("--arrival replay needs trace timestamps in non-decreasing order")
    start = values[0]
    return [(s - start) / time_scale for s in values]
