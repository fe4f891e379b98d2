"""Load profiles as GuideLLM names them, resolved into the two things the load generator knows: when each
request is due (an ArrivalConfig) and how many may be in flight (a concurrency cap).

    synchronous   one request at a time, the next when the previous ends (cap 1, all due at once)
    concurrent    N streams, each sending its next request when the previous ends (--max-concurrency N)
    throughput    everything due at once, optionally under --max-concurrency
    constant      --rate R at fixed gaps, optionally under --max-concurrency
    poisson       --rate R with exponential gaps, optionally under --max-concurrency

Without --profile the flags combine as in `vllm bench serve`: --rate/--arrival/--burstiness draw the due
times and --max-concurrency caps what is in flight (rate-limited with a cap; closed loop at --rate inf).
A profile fixes what it names, so a flag that contradicts it is an error, never silently dropped.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from conveyor.bench.trace.arrivals import ArrivalConfig, ArrivalProcess


class LoadProfile(str, enum.Enum):
    SYNCHRONOUS = "synchronous"
    CONCURRENT = "concurrent"
    THROUGHPUT = "throughput"
    CONSTANT = "constant"
    POISSON = "poisson"


class LoadProfileError(ValueError):
    """Flags that contradict the profile; the message names them."""


@dataclass(frozen=True, kw_only=True)
class LoadFlags:
    """The load-shape flags of `conveyor bench run`, as given."""

    profile: LoadProfile | None
    """--profile (None: the flags alone decide)."""
    request_rate: float
    """--rate (math.inf: all due at once)."""
    arrival: ArrivalProcess | None
    """--arrival (None: poisson unless the profile says otherwise)."""
    max_concurrency: int | None
    """--max-concurrency (None: no cap)."""
    burstiness: float = 1.0
    """--burstiness (gamma shape)."""
    time_scale: float = 1.0
    """--time-scale (replay)."""
    seed: int = 0
    """--seed of the arrival draws."""


@dataclass(frozen=True)
class LoadShape:
    """What the load generator does."""

    arrival: ArrivalConfig
    """When each dispatch unit is due."""
    max_concurrency: int | None
    """Cap on requests in flight (None: open loop)."""


def resolve_load(flags: LoadFlags) -> LoadShape:
    """Flags -> arrival process and cap; raises LoadProfileError naming a contradicting flag."""
    if flags.max_concurrency is not None and flags.max_concurrency < 1:
        raise LoadProfileError(f"--max-concurrency must be >= 1, got {flags.max_concurrency}")
    process, rate, cap = _profile_shape(flags)
    arrival = ArrivalConfig(process=process, request_rate=rate, burstiness=flags.burstiness,
                            time_scale=flags.time_scale, seed=flags.seed)
    return LoadShape(arrival=arrival, max_concurrency=cap)


def _profile_shape(flags: LoadFlags) -> tuple[ArrivalProcess, float, int | None]:
    profile, finite_rate = flags.profile, math.isfinite(flags.request_rate)
    if profile is None:
        return flags.arrival or ArrivalProcess.POISSON, flags.request_rate, flags.max_concurrency
    name = f"--profile {profile.value}"
    if profile in (LoadProfile.CONSTANT, LoadProfile.POISSON):
        wanted = ArrivalProcess(profile.value)
        if flags.arrival not in (None, wanted):
            raise LoadProfileError(f"{name} draws {wanted.value} arrivals; drop --arrival {flags.arrival.value}")
        if not finite_rate:
            raise LoadProfileError(f"{name} needs a finite --rate (requests per second)")
        return wanted, flags.request_rate, flags.max_concurrency
    if flags.arrival is not None:
        raise LoadProfileError(f"{name} sends requests as slots free up; drop --arrival {flags.arrival.value}")
    if finite_rate:
        raise LoadProfileError(f"{name} is not rate-limited; drop --rate (or use --profile constant|poisson "
                               "with --max-concurrency)")
    if profile is LoadProfile.SYNCHRONOUS:
        if flags.max_concurrency not in (None, 1):
            raise LoadProfileError(f"{name} is one request at a time; drop --max-concurrency")
        return ArrivalProcess.CONSTANT, math.inf, 1
    if profile is LoadProfile.CONCURRENT and flags.max_concurrency is None:
        raise LoadProfileError(f"{name} needs --max-concurrency N (the number of streams; GuideLLM's --rate "
                               "for this profile)")
    return ArrivalProcess.CONSTANT, math.inf, flags.max_concurrency
