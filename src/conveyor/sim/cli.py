"""`conveyor simulate`: the real scheduler on a virtual clock, on a synthetic workload or a real trace.

Without --trace or --validate it is core/simulate_cli.py's continuous-vs-static comparison on two-class
Poisson arrivals (its flags are all here too). With --trace it replays a conveyor trace at --rate (as
`conveyor bench run` would send it) on the engine the flags describe, and writes a run directory that
`conveyor report` reads like a measured one (sim/replay.py). With --validate it replays measured runs and
prints the simulation's error per metric (sim/validate.py).
"""

from __future__ import annotations

import argparse
import pathlib
import shlex
import sys

from conveyor.bench.decide.study import load_study_file
from conveyor.bench.load.profiles import LoadProfile
from conveyor.bench.measure.rundirs import RunDirError, prepare_out_dir
from conveyor.bench.measure.runner import dashboard_table
from conveyor.bench.plan.memory import PlanInputs
from conveyor.bench.trace.traces import TraceError
from conveyor.core import simulate_cli
from conveyor.sim.cross_hardware import retarget_study, scaled_for_validation
from conveyor.sim.engine_setup import (
    add_engine_flags,
    apply_engine_flags,
    default_setup,
)
from conveyor.sim.replay import calibration_entries, run_trace, step_price
from conveyor.sim.study import (
    SimulatedServers,
    shortlist,
    simulate_study,
    write_shortlist,
)
from conveyor.sim.validate import (
    fitted_runs,
    refuse_fitted,
    terminal_table,
    validate_runs,
    write_tables,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    simulate_cli.add_arguments(parser)
    add_engine_flags(parser)
    trace = parser.add_argument_group("replay a trace (as `conveyor bench run` sends it)")
    trace.add_argument("--trace", metavar="T.jsonl", help="replay this conveyor trace and write a run directory")
    trace.add_argument("--out-dir", metavar="DIR", help="the run directory --trace writes")
    trace.add_argument("--label", help="the run's name in tables (default: the directory's)")
    trace.add_argument("--rate", type=float, help="dispatch units per second, as bench run --rate (default inf)")
    trace.add_argument("--arrival", choices=["poisson", "gamma", "constant", "replay"])
    trace.add_argument("--burstiness", type=float, default=1.0, help="gamma shape k (gamma arrivals)")
    trace.add_argument("--time-scale", type=float, default=1.0, help="replay: trace seconds per simulated second")
    trace.add_argument("--max-concurrency", type=int, help="at most this many requests in flight (a closed loop)")
    trace.add_argument("--profile", choices=[p.value for p in LoadProfile], help="GuideLLM's load profiles, as bench run")
    hardware = parser.add_argument_group("cross-hardware what-if (with --trace or --study, or --validate for its error, and --calibration)")
    hardware.add_argument("--target-gpu", metavar="GPU", help="scale the calibration to this catalog GPU (H100, H200, "
                          "...): weight and KV reads by bandwidth, token compute by bf16 FLOP/s (with --model-config, only each "
                          "term's work at the source's peak; the rest as measured)")
    hardware.add_argument("--model-config", metavar="CONFIG.json", help="the model's config.json, for the target's "
                          "KV pool from the memory plan (or give --num-gpu-blocks-override) and each term's "
                          "roofline floor")
    hardware.add_argument("--gpu-memory-utilization", type=float, default=PlanInputs.gpu_memory_utilization,
                          help="for the memory plan (default: the engine's, %(default)s)")
    study = parser.add_argument_group("simulate, then verify: a study on the simulator, to shortlist configurations")
    study.add_argument("--study", metavar="STUDY.toml", help="run this `bench study` file on the simulator (with "
                       "--calibration) into --out-dir, and write the shortlist to verify on servers")
    study.add_argument("--shortlist", type=int, default=2, metavar="K",
                       help="configurations besides the baseline to shortlist (default 2)")
    check = parser.add_argument_group("validate on measured runs")
    check.add_argument("--validate", nargs="+", metavar="RUN_DIR",
                       help="replay these measured runs (their trace, rate, flags) with --calibration and print the "
                            "error per metric; tables and simulated twins go to --out-dir (default simulate-validation)")


def run(args: argparse.Namespace) -> int:
    if args.trace is None and args.validate is None and args.study is None:
        return simulate_cli.run(args)
    command = "conveyor simulate " + shlex.join(sys.argv[2:])
    try:
        if args.validate is not None:
            return _validate(args, command)
        if args.study is not None:
            return _study(args)
        summary, num_steps = run_trace(args, command)
    except (ValueError, TraceError, RunDirError) as error:  # each names the flag or the run directory
        print(f"conveyor simulate: error: {error}", file=sys.stderr)
        return 2
    simulated = summary.simulated
    print(f"simulated {summary.num_prompts} requests of {args.trace} in {num_steps} engine steps; step = "
          f"{simulated.step_time if simulated else '?'}; wrote {args.out_dir}")
    print(dashboard_table([summary]))
    return 0


def _validate(args: argparse.Namespace, command: str) -> int:
    if args.trace is not None:
        raise ValueError("--validate replays each run as it ran: drop --trace")
    if args.calibration is None:
        raise ValueError("--validate needs --calibration FILE (the step-time model whose error it measures)")
    run_dirs = [pathlib.Path(d) for d in args.validate]
    refuse_fitted(run_dirs, fitted_runs(pathlib.Path(args.calibration), args.calibration_hardware))
    step_time, simulated = step_price(args)
    if args.target_gpu is not None:  # cross-hardware: a calibration of one GPU against runs on another
        found = calibration_entries(pathlib.Path(args.calibration), args.calibration_hardware)
        config = pathlib.Path(args.model_config) if args.model_config is not None else None
        step_time, simulated = scaled_for_validation(step_time, found, args.target_gpu, simulated, config)
    out_dir = pathlib.Path(args.out_dir or "simulate-validation")
    results = validate_runs(run_dirs, step_time, simulated, out_dir, command,
                            lambda setup: apply_engine_flags(setup, args))
    print(f"simulation error on {len(results)} measured run(s); step = {simulated.step_time}")
    print(terminal_table(results))
    for note in (n for r in results for n in r.notes):
        print(f"note: {note}")
    print(f"wrote {write_tables(out_dir, results)} and validation.csv; simulated twins in {out_dir / 'runs'}")
    return 0


def _study(args: argparse.Namespace) -> int:
    if args.trace is not None:
        raise ValueError("--study replays the study's own traces: drop --trace")
    if args.calibration is None or not args.out_dir:
        raise ValueError("--study needs --calibration FILE (what a step costs) and --out-dir DIR")
    if args.shortlist < 1:
        raise ValueError(f"--shortlist must be >= 1 (got {args.shortlist})")
    out_dir, study_file = pathlib.Path(args.out_dir), pathlib.Path(args.study)
    try:
        prepare_out_dir(out_dir, force=False)
    except RunDirError:
        raise ValueError(f"--out-dir {out_dir} already holds a run or study; choose another directory") from None
    spec = load_study_file(study_file)
    step_time, simulated = step_price(args)
    pool = None
    if args.target_gpu is not None:  # the study on a GPU the calibration was not measured on
        found = calibration_entries(pathlib.Path(args.calibration), args.calibration_hardware)
        step_time, simulated, pool = retarget_study(args, step_time, simulated, found)
    servers = SimulatedServers(apply_engine_flags(default_setup(), args), step_time, simulated, pool)
    simulate_study(spec, servers, out_dir)
    chosen = shortlist(spec, out_dir, args.shortlist)
    path = write_shortlist(study_file, spec, chosen, out_dir)
    print(f"simulated study of {len(spec.variants)} configurations in {out_dir} (conveyor report {out_dir}); "
          f"shortlist by simulated capacity:")
    for entry in chosen:
        rate = "none met the objective" if entry.max_rate_meeting is None else f"{entry.max_rate_meeting:.3g} req/s"
        print(f"  {entry.name}: {rate}")
    print(f"verify on servers: conveyor bench study {path} --out DIR")
    return 0
