"""`conveyor simulate`: continuous vs static batching on the step-level simulation (no model, no GPU).

Flags are kebab-case spellings of the fields of `WorkloadConfig`, `StepTimeModel`, `SchedulerConfig`
and `CacheConfig`; each defaults to None here and is passed on only when given, so the defaults live
in the dataclasses.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from conveyor.config import Batching, ConfigError, SchedulingPolicy
from conveyor.core.simulate import (
    SimulationConfig,
    SimulationResult,
    StepTimeModel,
    WorkloadConfig,
    compare,
    format_table,
    simulate,
)
from conveyor.core.step_time import CalibratedStepTime, read_calibration

_WORKLOAD_FLAGS = {"num_requests": int, "request_rate": float, "long_fraction": float, "short_prompt_tokens": int,
                   "short_output_tokens": int, "long_prompt_tokens": int, "long_output_tokens": int, "seed": int}
_STEP_FLAGS = {"step_time_base_s": float, "step_time_per_token_s": float}
_SCHEDULER_FLAGS = {"max_num_seqs": int, "max_num_batched_tokens": int, "max_model_len": int,
                    "long_prefill_token_threshold": int}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    workload = parser.add_argument_group("workload (Poisson arrivals of short and long requests)")
    for name, kind in _WORKLOAD_FLAGS.items():
        workload.add_argument(_flag(name), type=kind, help=_field_doc(WorkloadConfig, name))
    step = parser.add_argument_group("step time model: seconds per step = base + per_token * tokens")
    for name, kind in _STEP_FLAGS.items():
        step.add_argument(_flag(name), type=kind, help=_field_doc(StepTimeModel, name))
    step.add_argument("--calibration", metavar="FILE",
                      help="price each step by a model fitted to the engine's step log (conveyor bench calibrate) "
                           "instead of base + per_token")
    step.add_argument("--calibration-hardware", metavar="TEXT",
                      help="the calibration whose hardware contains TEXT, when the file holds several")
    step.add_argument("--step-spread", action="store_true",
                      help="with --calibration and --trace/--validate: draw each step's time from the spread the "
                           "calibration measured (seeded by --seed) instead of pricing like steps alike; shapes the "
                           "inter-token gaps' distribution, but moves every percentile from seed to seed")
    engine = parser.add_argument_group("scheduler and KV cache")
    for name, kind in _SCHEDULER_FLAGS.items():
        engine.add_argument(_flag(name), type=kind)
    engine.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None)
    engine.add_argument("--scheduling-policy", choices=[p.value for p in SchedulingPolicy])
    engine.add_argument("--block-size", type=int)
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    engine.add_argument("--num-gpu-blocks-override", type=int, help="KV blocks in the pool (default 4096)")
    parser.add_argument("--batching", choices=["both"] + [b.value for b in Batching], default="both",
                        help="policy to run (default: both, same arrivals)")
    parser.add_argument("--output-json", help="also write the results to this JSON file")


def build_config(args: argparse.Namespace) -> SimulationConfig:
    """The SimulationConfig the flags describe (ConfigError / ValueError on bad values)."""
    base = SimulationConfig()
    workload = replace(base.workload, **_given(args, _WORKLOAD_FLAGS))
    step_time: StepTimeModel | CalibratedStepTime = replace(StepTimeModel(), **_given(args, _STEP_FLAGS))
    if getattr(args, "calibration", None) is not None:
        if _given(args, _STEP_FLAGS):
            raise ConfigError("--calibration replaces --step-time-base-s and --step-time-per-token-s: give one")
        step_time = read_calibration(args.calibration, getattr(args, "calibration_hardware", None))
        if not getattr(args, "step_spread", False):  # the default prices like steps alike (docs/decision.md)
            step_time = replace(step_time, spread=())
    scheduler_fields = _given(args, _SCHEDULER_FLAGS)
    if args.enable_chunked_prefill is not None:
        scheduler_fields["enable_chunked_prefill"] = args.enable_chunked_prefill
    if args.scheduling_policy is not None:
        scheduler_fields["policy"] = SchedulingPolicy(args.scheduling_policy)
    cache_fields: dict[str, Any] = {}
    if args.block_size is not None:
        cache_fields["block_size"] = args.block_size
    if args.enable_prefix_caching is not None:
        cache_fields["enable_prefix_caching"] = args.enable_prefix_caching
    num_blocks = args.num_gpu_blocks_override if args.num_gpu_blocks_override is not None else base.num_blocks
    if num_blocks < 1:
        raise ConfigError(f"--num-gpu-blocks-override must be >= 1 (got {num_blocks})")
    return SimulationConfig(scheduler=replace(base.scheduler, **scheduler_fields),
                            cache=replace(base.cache, **cache_fields), num_blocks=num_blocks,
                            workload=workload, step_time=step_time)


def run(args: argparse.Namespace) -> int:
    try:
        config = build_config(args)
        if args.batching == "both":
            results = compare(config)
        else:
            batching = Batching(args.batching)
            results = [simulate(replace(config, scheduler=replace(config.scheduler, batching=batching)))]
    except ValueError as error:  # ConfigError and AdmissionError (a request that can never fit) included
        print(f"conveyor simulate: error: {error}", file=sys.stderr)
        return 2
    workload = config.workload
    print(f"{workload.num_requests} requests at {workload.request_rate}/s, {workload.long_fraction:.0%} long "
          f"({workload.long_prompt_tokens}+{workload.long_output_tokens} tokens) vs short "
          f"({workload.short_prompt_tokens}+{workload.short_output_tokens}); step = "
          f"{config.step_time.describe()}; "
          f"max_num_seqs={config.scheduler.max_num_seqs}")
    print(format_table(results))
    if args.output_json:
        with open(args.output_json, "w") as out:
            json.dump([_jsonable(r) for r in results], out, indent=2)
    return 0


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _given(args: argparse.Namespace, flags: Mapping[str, type]) -> dict[str, Any]:
    """The flags given on the command line (argparse has converted each to its field's type)."""
    return {name: getattr(args, name) for name in flags if getattr(args, name) is not None}


def _field_doc(cls: type, name: str) -> str:
    default = {f.name: f.default for f in dataclasses.fields(cls)}[name]
    return f"default {default}"


def _jsonable(result: SimulationResult) -> dict[str, object]:
    return {k: (v.value if isinstance(v, Batching) else v) for k, v in dataclasses.asdict(result).items()}
