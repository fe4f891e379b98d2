"""`conveyor bench run`: one run of a trace against a server (open loop, rate-limited with a concurrency cap,
or closed loop), written to a run directory."""

from __future__ import annotations

import argparse
import math
import pathlib
import shlex
import sys

from conveyor.bench.jsonvalue import Fields
from conveyor.bench.load.cache_mode import CacheMode
from conveyor.bench.load.profiles import LoadProfile
from conveyor.bench.load.retry import add_retry_arguments, policy_from_args
from conveyor.bench.load.workers import WorkerError
from conveyor.bench.measure.metrics import parse_goodput
from conveyor.bench.measure.rundirs import RunDirError, prepare_out_dir
from conveyor.bench.measure.runner import BenchError, BenchRunConfig, dashboard_table, run_benchmark
from conveyor.bench.measure.spec_metrics import describe_spec_decode
from conveyor.bench.trace.traces import TraceError


def parse_rate(text: str) -> float:
    if text.lower() in ("inf", "infinity"):
        return math.inf
    try:
        rate = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--rate {text!r} must be a number of req/s or inf") from exc
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"--rate {text!r} must be > 0")
    return rate


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = BenchRunConfig.__dataclass_fields__
    parser.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    parser.add_argument("--trace", required=True, help="trace file (conveyor trace make | import)")
    parser.add_argument("--rate", type=parse_rate, default=math.inf,
                        help="offered req/s (standalone requests and session starts), or inf (default)")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="at most N requests in flight (vLLM's flag): closed loop at --rate inf, else "
                             "rate-limited with a cap")
    parser.add_argument("--profile", default=None, choices=[p.value for p in LoadProfile],
                        help="GuideLLM's load profiles: synchronous (one at a time), concurrent (--max-concurrency "
                             "streams), throughput (all at once), constant / poisson (at --rate)")
    parser.add_argument("--burstiness", type=float, default=d["burstiness"].default, help="gamma shape k")
    parser.add_argument("--arrival", default=None, choices=["poisson", "gamma", "constant", "replay"],
                        help="how due times are drawn (default poisson)")
    parser.add_argument("--time-scale", type=float, default=d["time_scale"].default,
                        help="replay: trace seconds per wall second")
    parser.add_argument("--workers", type=int, default=d["num_workers"].default,
                        help="load-generator processes; the schedule is split across them (default 1)")
    add_window_arguments(parser)
    parser.add_argument("--endpoint", default=d["endpoint"].default, choices=["completions", "chat"])
    parser.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    parser.add_argument("--temperature", type=float, default=None,
                        help="sent with every request, as vllm bench serve's (default: not sent, the server's 1.0)")
    parser.add_argument("--out", required=True, help="run directory to write")
    parser.add_argument("--label", default="", help="run name in tables (default: the --out directory name)")
    parser.add_argument("--max-send-lag-ms", type=float, default=d["max_send_lag_p99_ms"].default,
                        help="run is invalid if p99 send lag exceeds this")
    parser.add_argument("--goodput", default=None, help="per-request bounds in ms, e.g. ttft:200,tpot:50")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--seed", type=int, default=d["seed"].default)
    parser.add_argument("--num-requests", type=int, default=None, help="send only the first N trace requests")
    parser.add_argument("--duration", dest="duration_s", type=float, default=None,
                        help="seconds of arrivals: the first ceil(rate x SECONDS) trace requests (--num-requests wins)")
    parser.add_argument("--request-timeout-s", type=float, default=d["request_timeout_s"].default)
    parser.add_argument("--scrape-interval-s", type=float, default=d["scrape_interval_s"].default)
    parser.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    parser.add_argument("--force", action="store_true", help="replace an existing run in --out")
    parser.add_argument("--collect-step-log", action="store_true",
                        help="write the server's step log for the run as step_log.jsonl (a conveyor server "
                             "started with --step-log-size N; nothing otherwise)")
    add_retry_arguments(parser)


def add_window_arguments(parser: argparse.ArgumentParser) -> None:
    d = BenchRunConfig.__dataclass_fields__
    group = parser.add_argument_group("steady-state window (requests sent outside it are recorded, not summarized)")
    group.add_argument("--warmup-requests", type=int, default=d["warmup_requests"].default,
                       help="the first N requests sent are warm-up")
    group.add_argument("--warmup-s", type=float, default=d["warmup_s"].default,
                       help="requests sent in the first S seconds are warm-up")
    group.add_argument("--cooldown-requests", type=int, default=d["cooldown_requests"].default,
                       help="the last N requests sent are cool-down")
    group.add_argument("--cooldown-s", type=float, default=d["cooldown_s"].default,
                       help="requests sent in the last S seconds of dispatch are cool-down")
    group.add_argument("--cache-mode", default=None, choices=[m.value for m in CacheMode],
                       help="isolated (default): every request of a run carries one per-run cache_salt, so no run "
                            "hits prefix-cache blocks an earlier run left; warm: no salt, and the trace's prompts "
                            "are replayed once before measuring (a warm-cache steady state on purpose)")


def config_from_args(args: argparse.Namespace) -> BenchRunConfig:
    slo = parse_goodput(args.goodput) if args.goodput else None
    return BenchRunConfig(
        base_url=args.base_url, trace_path=args.trace, request_rate=args.rate, out_dir=args.out, label=args.label,
        burstiness=args.burstiness, arrival=args.arrival, time_scale=args.time_scale, endpoint=args.endpoint,
        temperature=args.temperature, model=args.model, seed=args.seed, max_send_lag_p99_ms=args.max_send_lag_ms,
        request_timeout_s=args.request_timeout_s, scrape_interval_s=args.scrape_interval_s, slo=slo,
        api_key=args.api_key, num_requests=args.num_requests, duration_s=args.duration_s, show_progress=not args.no_progress,
        profile=args.profile, max_concurrency=args.max_concurrency, num_workers=args.workers,
        warmup_requests=args.warmup_requests, warmup_s=args.warmup_s, cooldown_requests=args.cooldown_requests,
        cooldown_s=args.cooldown_s, cache_mode=args.cache_mode or CacheMode.ISOLATED.value,
        command=shlex.join(["conveyor", *sys.argv[1:]]), retry=policy_from_args(args),
        collect_step_log=getattr(args, "collect_step_log", False))


def run(args: argparse.Namespace) -> int:
    try:
        prepare_out_dir(pathlib.Path(args.out), args.force)
        summary = run_benchmark(config_from_args(args))
    except (BenchError, TraceError, RunDirError, ValueError, WorkerError) as exc:
        print(f"conveyor bench run: error: {exc}", file=sys.stderr)
        return 2
    print(dashboard_table([summary]))
    spec_line = describe_spec_decode(summary.server)
    if spec_line is not None:
        print(spec_line)
    print(f"{summary.completed} completed, {summary.cancelled} cancelled, {summary.failed} failed "
          f"of {summary.num_prompts} measured; {Fields(summary.window, 'window').opt_text('label')}; run directory {args.out}")
    print(summary.cache.describe())
    if summary.cache.warning:
        print(f"WARNING: {summary.cache.warning}", file=sys.stderr)
    if not summary.valid:
        print(f"INVALID RUN: {summary.validity.invalid_reason}", file=sys.stderr)
        return 1
    return 0
