"""`conveyor simulate`: the real scheduler on a virtual clock, on a synthetic workload or a real trace.

Without --trace or --validate it is core/simulate_cli.py's continuous-vs-static comparison on two-class
Poisson arrivals (its flags are all here too). With --trace it replays a conveyor trace at --rate (as
`conveyor bench run` would send it) on the engine the flags describe, and writes a run directory that
`conveyor report` reads like a measured one (sim/replay.py). With --validate it replays measured runs and
prints the simulation's error per metric (sim/validate.py).
"""

from __future__ import annotations

import argparse
import shlex
import sys

from conveyor.bench.measure.runner import dashboard_table
from conveyor.bench.trace.traces import TraceError
from conveyor.core import simulate_cli
from conveyor.sim.engine_setup import add_engine_flags
from conveyor.sim.replay import run_trace


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


def run(args: argparse.Namespace) -> int:
    if args.trace is None:
        return simulate_cli.run(args)
    try:
        summary, num_steps = run_trace(args, "conveyor simulate " + shlex.join(sys.argv[2:]))
    except (ValueError, TraceError) as error:  # ConfigError, LoadProfileError and TraceError name the flag
        print(f"conveyor simulate: error: {error}", file=sys.stderr)
        return 2
    simulated = summary.simulated
    print(f"simulated {summary.num_prompts} requests of {args.trace} in {num_steps} engine steps; step = "
          f"{simulated.step_time if simulated else '?'}; wrote {args.out_dir}")
    print(dashboard_table([summary]))
    return 0
