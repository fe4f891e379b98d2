"""One replay: a trace's requests through the real scheduler on the engine setup, priced by a step-time model.

Shared by `simulate --trace` (a what-if: flags changed, a run directory written) and `simulate --validate`
(a measured run's own trace, rate and flags, compared with what was measured).
"""

from __future__ import annotations

import argparse
import math
import pathlib
import re

from conveyor.bench.measure.calibration import Calibration, read_calibrations
from conveyor.bench.measure.summary import RunSummary, Simulated
from conveyor.bench.trace.traces import read_trace
from conveyor.core import simulate_cli
from conveyor.core.simulate import StepTimeModel
from conveyor.core.step_time import CalibratedStepTime
from conveyor.core.trace_sim import TraceSimConfig, TraceSimResult, simulate_trace
from conveyor.sim.cross_hardware import retarget
from conveyor.sim.engine_setup import apply_engine_flags, default_setup
from conveyor.sim.run_dir import SimRunSpec, write_run_dir
from conveyor.sim.workload import LoadSettings, sim_requests

StepPrice = StepTimeModel | CalibratedStepTime
_POISSON_ONLY = ("request_rate", "long_fraction", "short_prompt_tokens", "short_output_tokens", "long_prompt_tokens",
                 "long_output_tokens")
"""core/simulate_cli.py's workload flags that a trace replaces (--num-requests and --seed keep a meaning)."""


def replay(spec: SimRunSpec, step_time: StepPrice) -> TraceSimResult:
    setup = spec.setup
    config = TraceSimConfig(setup.scheduler, setup.cache, setup.num_blocks, step_time,
                            max_concurrency=spec.load.shape().max_concurrency, seed=spec.load.seed)
    return simulate_trace(sim_requests(spec.trace, spec.load), config)


def step_price(args: argparse.Namespace) -> tuple[StepPrice, Simulated]:
    """The step-time model the flags name (a calibration, or base + per token), and how the run records it."""
    model = simulate_cli.build_config(args).step_time
    calibration = getattr(args, "calibration", None)
    if calibration is None:
        return model, Simulated(model.describe())
    found = calibration_entries(pathlib.Path(calibration), getattr(args, "calibration_hardware", None))
    hardware = found[0].key.hardware if len(found) == 1 else "cpu"
    gpu = None if hardware == "cpu" else re.sub(r" x\d+$", "", hardware)  # "NVIDIA H100 80GB HBM3 x1": one GPU's name
    return model, Simulated(model.describe(), str(calibration), gpu_name=gpu)


def calibration_entries(path: pathlib.Path, hardware: str | None) -> list[Calibration]:
    """The file's calibrations that --calibration-hardware picks, by the rule core/step_time.py reads with
    (the step times come from there; the record, with its key and fitted runs, from here)."""
    return [c for c in read_calibrations(path) if hardware is None or hardware.lower() in c.key.hardware.lower()]


def load_from_args(args: argparse.Namespace) -> LoadSettings:
    rate = math.inf if args.rate is None else args.rate
    if not rate > 0:
        raise ValueError(f"--rate must be > 0 or inf (got {args.rate})")
    return LoadSettings(request_rate=rate, arrival=args.arrival, burstiness=args.burstiness,
                        time_scale=args.time_scale, seed=args.seed or 0, num_requests=args.num_requests,
                        profile=args.profile, max_concurrency=args.max_concurrency)


def run_trace(args: argparse.Namespace, command: str) -> tuple[RunSummary, int]:
    """`simulate --trace`: replay, write --out-dir, return its summary and the engine steps it took."""
    if not args.out_dir:
        raise ValueError("--trace needs --out-dir DIR (the run directory to write)")
    poisson = [name for name in _POISSON_ONLY if getattr(args, name, None) is not None]
    if poisson:
        raise ValueError(f"--{poisson[0].replace('_', '-')} shapes the Poisson workload; with --trace the trace is "
                         "the workload (--rate sets its pace)")
    out_dir = pathlib.Path(args.out_dir)
    if (out_dir / "summary.json").exists():
        raise ValueError(f"--out-dir {out_dir} already holds a run; pick a new directory")
    step_time, simulated = step_price(args)
    setup = apply_engine_flags(default_setup(), args)
    if args.target_gpu is not None:
        found = calibration_entries(pathlib.Path(args.calibration), args.calibration_hardware) if args.calibration else []
        step_time, setup, simulated = retarget(args, step_time, setup, simulated, found)
    spec = SimRunSpec(args.label or out_dir.name, args.trace, read_trace(args.trace), load_from_args(args),
                      setup, simulated)
    result = replay(spec, step_time)
    return write_run_dir(out_dir, spec, result, command), result.num_steps
