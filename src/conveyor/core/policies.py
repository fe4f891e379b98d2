"""The batching policy a `SchedulerConfig` names. Apart from scheduler.py and its subclasses so that
no module imports its own subclass (a cycle)."""

from __future__ import annotations

import time
from collections.abc import Callable

from conveyor.config import Batching, CacheConfig, SchedulerConfig, SpeculativeConfig
from conveyor.core.async_scheduler import AsyncScheduler
from conveyor.core.scheduler import Scheduler
from conveyor.core.static_scheduler import StaticScheduler


def make_scheduler(scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int,
                   clock: Callable[[], float] = time.monotonic,
                   speculative_config: SpeculativeConfig | None = None) -> Scheduler:
    """`scheduler_config.batching`, with async scheduling when asked (continuous batching only), and
    speculative decoding when `speculative_config` is given (not with async scheduling: a step's drafts
    are proposed from the previous step's tokens, which async scheduling has not collected yet)."""
    if speculative_config is not None and scheduler_config.async_scheduling:
        raise ValueError("speculative decoding cannot run with async scheduling (EngineConfig refuses it)")
    if scheduler_config.batching is Batching.CONTINUOUS:
        policy = AsyncScheduler if scheduler_config.async_scheduling else Scheduler
        return policy(scheduler_config, cache_config, num_blocks, clock, speculative_config)
    if scheduler_config.batching is Batching.STATIC:
        return StaticScheduler(scheduler_config, cache_config, num_blocks, clock, speculative_config)
    raise ValueError(f"unknown batching {scheduler_config.batching!r}")
