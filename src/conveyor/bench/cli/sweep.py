"""`conveyor bench sweep`: one server, offered rates (or, with --over concurrency, closed-loop concurrency
levels) rising until the objective breaks, the boundary bisected, repeats per point; then the dashboard
and recommendation, and an HTML report in OUT/report/. With --server-command the sweep starts (and
stops) the server itself from a command template."""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import sys
from collections.abc import Iterator
from typing import Any

from conveyor.bench.cli.run import add_window_arguments, parse_rate
from conveyor.bench.decide.slo import SLOError, parse_slo_flag
from conveyor.bench.decide.run_fn import RunFn, RunTemplate, make_run_fn
from conveyor.bench.decide.run_options import RunOptions
from conveyor.bench.decide.sweep import SweepConfig, SweepError, SweepResult, run_sweep
from conveyor.bench.decide.sweep_axis import SweepAxis
from conveyor.bench.load.launch import LaunchError, ServerProcess, ServerSpec
from conveyor.bench.load.progress import ProgressReporter
from conveyor.bench.load.retry import add_retry_arguments, policy_from_args
from conveyor.bench.measure.rundirs import RunDirError, prepare_out_dir
from conveyor.bench.measure.summary import RunSummary
from conveyor.bench.report.dashboard import MixedRunsError, ReportInputs, analyze, format_terminal
from conveyor.bench.report.write import write_report

_RUN_OPTIONS = ("endpoint", "model", "burstiness", "arrival", "seed", "num_requests", "duration_s",
                "request_timeout_s", "max_send_lag_p99_ms", "scrape_interval_s", "api_key", "num_workers", "warmup_requests",
                "warmup_s", "cooldown_requests", "cooldown_s", "cache_mode")


def add_run_option_arguments(parser: argparse.ArgumentParser) -> None:
    """The `conveyor bench run` options that stay fixed across a sweep's runs (same spelling)."""
    group = parser.add_argument_group("each run (as conveyor bench run)")
    group.add_argument("--endpoint", choices=["completions", "chat"])
    group.add_argument("--model", help="model name (default: first of /v1/models)")
    group.add_argument("--burstiness", type=float, help="gamma shape k")
    group.add_argument("--arrival", choices=["poisson", "gamma", "constant", "replay"])
    group.add_argument("--seed", type=int, help="arrival seed of repeat 0 (repeat k uses seed + k)")
    group.add_argument("--num-requests", type=int, help="send only the first N trace requests per run")
    group.add_argument("--duration", dest="duration_s", type=float,
                       help="seconds of arrivals per run: ceil(rate x SECONDS) requests, as long at every rate")
    group.add_argument("--request-timeout-s", type=float)
    group.add_argument("--max-send-lag-ms", dest="max_send_lag_p99_ms", type=float)
    group.add_argument("--scrape-interval-s", type=float)
    group.add_argument("--api-key")
    group.add_argument("--workers", dest="num_workers", type=int, help="load-generator processes per run")
    group.add_argument("--max-concurrency", type=int,
                       help="cap each run at N in flight (a concurrency sweep: the highest level tried)")
    add_retry_arguments(group)
    add_window_arguments(parser)


def run_options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The runs' options; the per-run progress line is off (the sweep's own progress replaces it)."""
    options = {k: getattr(args, k) for k in _RUN_OPTIONS if getattr(args, k, None) is not None}
    options["show_progress"] = False
    policy = policy_from_args(args)
    if policy is not None:
        options["retry"] = policy
    by_concurrency = getattr(args, "over", SweepAxis.RATE.value) == SweepAxis.CONCURRENCY.value
    if not by_concurrency and args.max_concurrency is not None:
        options["max_concurrency"] = args.max_concurrency
    if by_concurrency and args.rate is not None:
        options["request_rate"] = args.rate
    return {k: v for k, v in options.items() if not (k.startswith(("warmup", "cooldown")) and not v)}


def counting(run_fn: RunFn, reporter: ProgressReporter) -> RunFn:
    """`run_fn`, advancing the progress bar after each run."""

    def run(rate: float, repeat: int, run_dir: pathlib.Path, num_requests: int | None) -> RunSummary:
        summary = run_fn(rate, repeat, run_dir, num_requests)
        state = "INVALID" if not summary.valid else f"{summary.completed} completed"
        reporter.run_done(f"{run_dir.parent.name}/{run_dir.name} ({state})")
        return summary

    return run


def estimated_runs(cfg: SweepConfig, num_rates: int | None = None) -> int:
    """Runs a sweep will likely take: its rates (searched: max points + bisections) x its minimum repeats."""
    rates = num_rates if num_rates is not None else min(cfg.max_points, 4) + cfg.bisect_steps
    return rates * cfg.num_repeats


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("rate search")
    group.add_argument("--start-rate", type=float, help="first offered req/s, below the expected load")
    group.add_argument("--growth-factor", type=float, help="ratio between successive rates (default 2)")
    group.add_argument("--max-rate", type=float, help="never offer more req/s than this")
    group.add_argument("--max-points", type=int, help="most rates before bisection (default 8)")
    group.add_argument("--bisect-steps", type=int, help="bisections of the boundary (default 2)")
    group.add_argument("--repeats", dest="num_repeats", type=int, help="repeats every rate runs (default 2)")
    group.add_argument("--max-repeats", type=int, help="most repeats of a rate whose verdict is undecided (default 5)")
    group.add_argument("--max-duration", dest="max_duration_s", type=float,
                       help="most run seconds spent on one rate, its repeats together (default: no limit)")
    group.add_argument("--max-invalid-reruns", type=int,
                       help="times an invalid run (client fell behind) is run again (default 2)")
    group.add_argument("--lengthen-factor", type=float,
                       help="a repeat after one whose rate was not shown sustained sends this many times its "
                            "requests (default 2; 1: never lengthen)")
    group.add_argument("--max-requests", type=int,
                       help="never lengthen a run past this many requests (default: the trace's length)")


def sweep_options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("start_rate", "growth_factor", "max_rate", "max_points", "bisect_steps", "num_repeats", "max_repeats",
            "max_duration_s", "max_invalid_reruns", "lengthen_factor", "max_requests")
    options: dict[str, Any] = {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}
    if getattr(args, "over", SweepAxis.RATE.value) == SweepAxis.CONCURRENCY.value:  # bench sweep only
        options.update(axis=SweepAxis.CONCURRENCY, start_rate=float(args.start_concurrency or 1))
        if args.max_concurrency is not None:
            options["max_rate"] = float(args.max_concurrency)
    return options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", help="running server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--server-command", help="or start one: template with {port} {host}, e.g. "
                                                 "'conveyor serve --port {port} --max-num-seqs 8'")
    parser.add_argument("--trace", required=True, help="trace file replayed at every rate")
    parser.add_argument("--slo", required=True,
                        help="objective: ttft_p95_ms=500,e2e_p95_ms=5000,error_rate=0.01 or a JSON/TOML file")
    parser.add_argument("--out", required=True, type=pathlib.Path, help="sweep directory to write")
    parser.add_argument("--name", help="configuration name (default: the --out directory name)")
    parser.add_argument("--force", action="store_true", help="replace an existing sweep in --out")
    add_sweep_arguments(parser)
    group = parser.add_argument_group("concurrency search (bench sweep only)")
    group.add_argument("--over", default=SweepAxis.RATE.value, choices=[a.value for a in SweepAxis],
                       help="sweep the offered rate (default) or the concurrency of a closed loop (vLLM's "
                            "--max-concurrency, GuideLLM's concurrent profile)")
    group.add_argument("--start-concurrency", type=int, help="first concurrency level (default 1)")
    group.add_argument("--rate", type=parse_rate, help="also rate-limit each run of a concurrency sweep")
    add_run_option_arguments(parser)


@contextlib.contextmanager
def _server(args: argparse.Namespace, name: str) -> Iterator[str]:
    if args.server_command:
        spec = ServerSpec(name=name, command=args.server_command)
        with ServerProcess(spec, args.out / "server") as server:
            yield server.base_url
    else:
        yield args.base_url


def run(args: argparse.Namespace) -> int:
    if bool(args.base_url) == bool(args.server_command):
        print("conveyor bench sweep: give exactly one of --base-url and --server-command", file=sys.stderr)
        return 2
    name = args.name or args.out.name
    try:
        prepare_out_dir(args.out, args.force)
        slo = parse_slo_flag(args.slo)
        cfg = SweepConfig(slo=slo, **sweep_options_from_args(args))
        reporter = ProgressReporter(estimated_runs(cfg))
        with _server(args, name) as base_url:
            options = RunOptions.from_mapping(run_options_from_args(args), "flags")
            template = RunTemplate(base_url, args.trace, name, slo, options, cfg.axis)
            result = run_sweep(name, cfg, counting(make_run_fn(template), reporter), args.out, progress=reporter)
        reporter.close()
        if cfg.axis is SweepAxis.CONCURRENCY:  # the report groups runs by offered rate, inf for every level
            return _concurrency_lines(result, args.out)
        analysis = analyze(ReportInputs((args.out,), slo))
    except (SLOError, SweepError, LaunchError, RunDirError, MixedRunsError, ValueError) as error:
        print(f"conveyor bench sweep: {error}", file=sys.stderr)
        return 2
    print(format_terminal(analysis))
    paths = write_report(analysis, args.out / "report")
    config = analysis.configs[0] if analysis.configs else None
    found = "none met" if result.max_rate_meeting is None else f"{result.max_rate_meeting:.3g} req/s"
    capacity = f" (capacity {config.capacity.describe()})" if config is not None else ""
    print(f"\nHighest rate meeting the objective: {found}{capacity}; report: {paths['html']}")
    return 0


def _concurrency_lines(result: SweepResult, out: pathlib.Path) -> int:
    for point in result.points:
        print(f"concurrency {point.rate:g}: {point.status.upper()}  "
              + "; ".join(f"{k} {v['median']:.4g}" for k, v in point.spread.items()))
    found = "none met" if result.max_rate_meeting is None else str(result.max_rate_meeting)
    print(f"\nHighest concurrency meeting the objective: {found}; runs in {out}")
    return 0
