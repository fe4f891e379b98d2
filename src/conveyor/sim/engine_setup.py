"""The engine a trace is replayed on: scheduler limits, block geometry and pool size, from flags.

Two sources, one shape. A measured run records the server's resolved flags in summary.json
`fixed.server_flags` (conveyor:config_info's labels: `max_num_seqs`, `block_size`, `num_kv_blocks`, ...),
so `simulate --validate` replays a run on the very engine that served it. On the command line the same
settings are vLLM's flag names (`--max-num-seqs`, `--num-gpu-blocks-override`, ...), applied on top: any
scheduler parameter can be changed for a what-if.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from conveyor.config import (
    Batching,
    CacheConfig,
    ConfigError,
    SchedulerConfig,
    SchedulingPolicy,
)

DEFAULT_NUM_BLOCKS = 4096
"""Pool size when neither a run nor a flag gives one (the Poisson simulation's default)."""


@dataclass(frozen=True)
class EngineSetup:
    """What the replay's scheduler is built from."""

    scheduler: SchedulerConfig
    cache: CacheConfig
    num_blocks: int
    """KV blocks in the pool."""


def _flag_bool(value: str) -> bool:
    if value.lower() not in ("true", "false"):
        raise ValueError(f"not true or false: {value!r}")
    return value.lower() == "true"


def _opt(kind: Callable[[str], object]) -> Callable[[str], object]:
    """A flag value that may be `none` (unset), as the engine renders None."""
    return lambda value: None if value.lower() == "none" else kind(value)


_SCHEDULER_FIELDS: dict[str, tuple[str, Callable[[str], object]]] = {
    "max_num_seqs": ("max_num_seqs", int), "max_num_batched_tokens": ("max_num_batched_tokens", int),
    "max_model_len": ("max_model_len", int), "enable_chunked_prefill": ("enable_chunked_prefill", _flag_bool),
    "long_prefill_token_threshold": ("long_prefill_token_threshold", _opt(int)),
    "scheduling_policy": ("policy", SchedulingPolicy), "batching": ("batching", Batching),
    "max_num_queued_reqs": ("max_num_queued_reqs", _opt(int)), "queue_timeout": ("queue_timeout_s", _opt(float)),
    "async_scheduling": ("async_scheduling", _flag_bool)}
"""server_flags key -> (SchedulerConfig field, parser of the engine's rendering)."""
_CACHE_FIELDS: dict[str, tuple[str, Callable[[str], object]]] = {
    "block_size": ("block_size", int), "enable_prefix_caching": ("enable_prefix_caching", _flag_bool)}
SIMULATED_FLAGS = frozenset((*_SCHEDULER_FIELDS, *_CACHE_FIELDS))
"""The engine flags the simulation models (with num_gpu_blocks_override, the pool): what a what-if may change."""


def _fields(flags: Mapping[str, str], table: Mapping[str, tuple[str, Callable[[str], object]]],
            where: str) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, (name, parse) in table.items():
        if key in flags:
            try:
                out[name] = parse(flags[key])
            except ValueError:
                raise ConfigError(f"{where}: server flag {key}={flags[key]!r} is not a valid {name}") from None
    return out


def setup_from_server_flags(flags: Mapping[str, str], where: str) -> EngineSetup:
    """The engine a measured run's `fixed.server_flags` describe (engine defaults for what they lack: a vLLM
    server's vllm:cache_config_info has the block size, pool and prefix caching, not the scheduler limits)."""
    scheduler = SchedulerConfig(**_fields(flags, _SCHEDULER_FIELDS, where))  # type: ignore[arg-type]
    cache = CacheConfig(**_fields(flags, _CACHE_FIELDS, where))  # type: ignore[arg-type]
    blocks = flags.get("num_kv_blocks") or flags.get("num_gpu_blocks") or ""  # conveyor's label, vLLM's
    return EngineSetup(scheduler, cache, int(blocks) if blocks.isdigit() else DEFAULT_NUM_BLOCKS)


def default_setup() -> EngineSetup:
    """The engine's defaults, as `conveyor serve` starts without flags (pool size: DEFAULT_NUM_BLOCKS)."""
    return EngineSetup(SchedulerConfig(), CacheConfig(), DEFAULT_NUM_BLOCKS)


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """The scheduler flags `conveyor simulate` lacked (the rest are core/simulate_cli.py's, same names)."""
    group = parser.add_argument_group("more engine flags (vLLM names; with --trace / --validate)")
    group.add_argument("--max-num-queued-reqs", type=int)
    group.add_argument("--queue-timeout", type=float)
    group.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)


def apply_engine_flags(setup: EngineSetup, args: argparse.Namespace) -> EngineSetup:
    """`setup` with the flags given on the command line applied (ConfigError names a bad flag)."""
    given = {key: str(value) for key in (*SIMULATED_FLAGS, "num_gpu_blocks_override")
             if (value := getattr(args, key, None)) is not None and value != "both"}  # --batching both: the run's
    return apply_flags(setup, given, "flags")


def apply_flags(setup: EngineSetup, flags: Mapping[str, str], where: str) -> EngineSetup:
    """`setup` with engine flags (vLLM names, underscores) applied; `num_gpu_blocks_override` sizes the pool."""
    scheduler = replace(setup.scheduler, **_fields(flags, _SCHEDULER_FIELDS, where))  # type: ignore[arg-type]
    cache = replace(setup.cache, **_fields(flags, _CACHE_FIELDS, where))  # type: ignore[arg-type]
    blocks = flags.get("num_gpu_blocks_override", "none")
    if blocks.lower() != "none" and not (blocks.isdigit() and int(blocks) >= 1):
        raise ConfigError(f"{where}: num_gpu_blocks_override must be an integer >= 1 (got {blocks})")
    return EngineSetup(scheduler, cache, int(blocks) if blocks.isdigit() else setup.num_blocks)


def server_flags(setup: EngineSetup) -> dict[str, str]:
    """The setup as conveyor:config_info labels render it (the inverse of setup_from_server_flags), for the
    simulated run's `fixed.server_flags`."""
    s, c = setup.scheduler, setup.cache

    def text(value: object) -> str:
        if value is None:
            return "none"
        if isinstance(value, bool):
            return "true" if value else "false"
        return str(getattr(value, "value", value))

    values: dict[str, object] = {key: getattr(s, name) for key, (name, _) in _SCHEDULER_FIELDS.items()}
    values.update({key: getattr(c, name) for key, (name, _) in _CACHE_FIELDS.items()})
    values["num_kv_blocks"] = setup.num_blocks
    return {key: text(value) for key, value in values.items()}
