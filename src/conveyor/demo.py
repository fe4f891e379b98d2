"""`conveyor demo`: continuous vs static batching (and a small token budget) on the embedded model.

What it does, on this CPU and in a few minutes: writes a mixed trace (short chats and long prompts),
starts `conveyor serve` as a subprocess for each configuration (baseline continuous batching; the same
with `--batching static`; the same with a small `--max-num-batched-tokens`), measures the baseline's
capacity C and the objective once (a burst of 8 requests at once on the warm baseline), then offers
each configuration fixed rates that are fractions and multiples of C, and ends with the dashboard, the
recommendation, the checklist, the diagnosis and the HTML report. Rates and the objective are scaled to
the machine, so the same demo tells the same story on a laptop and in CI: steady traffic should be served
no worse than that burst (TTFT p95 <= the burst's p95 TTFT, E2E p95 <= 1.25 x its p95 E2E, error rate
<= 5%). Every configuration is warmed up with the same burst before it is measured. The engine is never
imported here; the server runs in its own process, exactly as a user would start it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import sys
import time
from dataclasses import dataclass
from typing import Any

from conveyor.bench.launch import LaunchError, ServerProcess
from conveyor.bench.report import ReportInputs, analyze, format_terminal, write_report
from conveyor.bench.rundirs import STUDY_FILE
from conveyor.bench.slo import SLO
from conveyor.bench.study import ConfigurationRunner, StudySpec, Variant, server_spec, study_record
from conveyor.bench.sweep import SweepConfig

_SRC_DIR = pathlib.Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class DemoConfig:
    """Size of the demo."""

    out_dir: pathlib.Path = pathlib.Path("conveyor-demo")
    """Where the trace, runs and report go."""
    num_requests: int = 12
    """Requests per run."""
    rate_factors: tuple[float, ...] = (0.4, 0.8, 3.0)
    """Offered rates as multiples of the measured capacity C."""
    num_repeats: int = 1
    """Runs per rate."""
    budget_variant: bool = True
    """Also run the small-token-budget variant."""
    seed: int = 0
    """Trace and arrival seed."""
    model: str | None = None
    """Model for `conveyor serve --model` (None: the embedded SmolLM2-135M)."""

    @classmethod
    def quick(cls, out_dir: pathlib.Path) -> DemoConfig:
        """The CI setting: two configurations, two rates, few requests (about two minutes)."""
        return cls(out_dir=out_dir, num_requests=8, rate_factors=(0.4, 1.5), budget_variant=False)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def write_demo_trace(cfg: DemoConfig) -> pathlib.Path:
    """A mixed trace small enough for a CPU: 70% short chats, 30% long prompts, short outputs."""
    from conveyor.bench.trace_gen import ChatParams, LongParams, TraceMakeConfig, make_mixed_trace
    from conveyor.bench.traces import write_trace

    trace = make_mixed_trace(TraceMakeConfig(
        mix={"chat": 0.7, "long": 0.3}, num_requests=cfg.num_requests, seed=cfg.seed,
        chat=ChatParams(prompt_len_median=24, prompt_len_max=64, output_len_median=12, output_len_max=24),
        long=LongParams(prompt_len_min=200, prompt_len_max=400, output_len_min=8, output_len_max=16)))
    path = cfg.out_dir / "trace.jsonl"
    write_trace(trace, path)
    return path


def demo_spec(cfg: DemoConfig, trace_path: pathlib.Path) -> StudySpec:
    """The study before calibration (objective and rates are filled in from the measured capacity)."""
    model = f" --model {cfg.model}" if cfg.model else ""
    command = (f"{sys.executable} -m conveyor serve --port {{port}} --max-model-len 1024 --max-num-seqs 8 "
               f"--kv-cache-memory 256MiB --seed {cfg.seed}{model} {{args}}")
    baseline = {"batching": "continuous", "max_num_batched_tokens": 512}
    variants = [Variant("continuous", baseline, None, 1.0, 1),
                Variant("static", {**baseline, "batching": "static"}, "batching", 1.0, 1)]
    if cfg.budget_variant:
        variants.append(Variant("budget64", {**baseline, "max_num_batched_tokens": 64},
                                "max_num_batched_tokens", 1.0, 1))
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(_SRC_DIR), os.environ.get("PYTHONPATH")]))}
    return StudySpec(
        command=command, trace_path=str(trace_path), slo=SLO(), variants=tuple(variants),
        sweep=SweepConfig(slo=SLO(), num_repeats=cfg.num_repeats),
        run_options={"seed": cfg.seed, "request_timeout_s": 120.0, "max_send_lag_p99_ms": 200.0},
        server_options={"env": env, "startup_timeout_s": 240.0, "num_warmup_requests": 2})


def _burst(base_url: str, cfg: DemoConfig, trace_path: pathlib.Path, out_dir: pathlib.Path) -> dict[str, Any]:
    """The first `max_num_seqs` (8) requests of the trace, all at once."""
    from conveyor.bench.runner import BenchRunConfig, run_benchmark

    return run_benchmark(BenchRunConfig(
        base_url=base_url, trace_path=str(trace_path), request_rate=math.inf, out_dir=str(out_dir),
        label=out_dir.name, num_requests=min(_BURST_SIZE, cfg.num_requests), request_timeout_s=120.0))


_BURST_SIZE = 8
"""Requests of the warm-up and calibration bursts: the servers' max_num_seqs, so all run at once."""
E2E_SLACK = 1.25
"""E2E bound / the burst's p95 E2E: a steady rate may cost a little more than one burst, not a backlog."""


def calibrated(spec: StudySpec, cfg: DemoConfig, burst: dict[str, Any]) -> StudySpec:
    """Objective from the baseline serving a burst of 8 requests at once: steady traffic should be no
    worse — TTFT p95 <= the burst's p95 TTFT, E2E p95 <= 1.25 x its p95 E2E, error rate <= 5%.
    Rates are multiples of the burst's completed req/s (the capacity C)."""
    capacity = float(burst.get("request_throughput") or 0.0)
    ttft_ms, e2e_ms = (float(burst.get(k) or 0.0) for k in ("p95_ttft_ms", "p95_e2el_ms"))
    if capacity <= 0 or ttft_ms <= 0 or e2e_ms <= 0:
        raise LaunchError(f"calibration completed no request (errors: {burst.get('errors_by_kind')})")
    slo = SLO(ttft_p95_ms=round(ttft_ms), e2e_p95_ms=round(E2E_SLACK * e2e_ms), error_rate=0.05)
    rates = tuple(round(f * capacity, 4) for f in cfg.rate_factors)
    _progress(f"[demo] burst of {_BURST_SIZE}: p95 TTFT {ttft_ms:.0f} ms, p95 E2E {e2e_ms:.0f} ms, capacity C = "
              f"{capacity:.3g} req/s -> objective {slo.to_dict()}, rates {rates} req/s")
    return dataclasses.replace(spec, slo=slo, rates=rates, main_rate=rates[0],
                               sweep=dataclasses.replace(spec.sweep, slo=slo))


def run_demo(cfg: DemoConfig) -> pathlib.Path:
    """The whole demo; returns the study directory (report in study/report/)."""
    started = time.monotonic()
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    spec = demo_spec(cfg, write_demo_trace(cfg))
    study_dir, trace_path = cfg.out_dir / "study", pathlib.Path(spec.trace_path)
    for index, variant in enumerate(spec.variants, start=1):
        _progress(f"[demo] configuration {index}/{len(spec.variants)}: {variant.name} "
                  f"({variant.changed or 'baseline'}) — {time.monotonic() - started:.0f} s elapsed")
        config_dir = study_dir / variant.name
        with ServerProcess(server_spec(spec, variant), config_dir, _progress) as server:
            # Every configuration is measured warm: the first long prefills pay one-time costs.
            _progress(f"[demo] warm-up burst of {_BURST_SIZE} requests on {variant.name}")
            _burst(server.base_url, cfg, trace_path, cfg.out_dir / "warmup" / variant.name)
            if index == 1:
                _progress("[demo] calibrating: a burst of 8 requests at once on the baseline")
                spec = calibrated(spec, cfg, _burst(server.base_url, cfg, trace_path, cfg.out_dir / "calibration"))
                (study_dir / STUDY_FILE).write_text(json.dumps(study_record(spec), indent=2))
            ConfigurationRunner(spec, progress=_progress).run(variant, server.base_url, config_dir)
    _progress(f"[demo] all configurations done in {time.monotonic() - started:.0f} s")
    return study_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = DemoConfig()
    parser.add_argument("--out", type=pathlib.Path, default=defaults.out_dir, help="output directory")
    parser.add_argument("--quick", action="store_true", help="reduced setting for CI (about 2 minutes)")
    parser.add_argument("--num-requests", type=int, help=f"requests per run (default {defaults.num_requests})")
    parser.add_argument("--repeats", type=int, help="runs per rate (default 1)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--model", help="model for conveyor serve (default: the embedded SmolLM2-135M)")


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    cfg = DemoConfig.quick(args.out) if args.quick else DemoConfig(out_dir=args.out)
    overrides = {"num_requests": args.num_requests, "num_repeats": args.repeats}
    cfg = dataclasses.replace(cfg, seed=args.seed, model=args.model,
                              **{k: v for k, v in overrides.items() if v is not None})
    if cfg.num_requests < 2 or cfg.num_repeats < 1:
        raise SystemExit("conveyor demo: --num-requests must be >= 2 and --repeats >= 1")
    return cfg


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    try:
        study_dir = run_demo(cfg)
    except LaunchError as error:
        print(f"conveyor demo: {error}", file=sys.stderr)
        return 1
    analysis = analyze(ReportInputs((study_dir,)))
    print(format_terminal(analysis))
    paths = write_report(analysis, cfg.out_dir / "report")
    print(f"\nReport: {paths['html']} (open it in a browser)")
    return 0
