"""`conveyor report RUN_DIR...`: the dashboard (terminal, Markdown or CSV), the recommendation, the
checklist and the diagnosis; with --out (default ./conveyor-report) also report.html with PNG plots.
Studies from several GPUs are one report: each configuration is (GPU, name), priced by `--price GPU=...`."""

from __future__ import annotations

import argparse
import pathlib
import sys

from conveyor.bench.decide.decision import CostModel
from conveyor.bench.decide.gpu_prices import PriceMatchError
from conveyor.bench.decide.slo import SLOError, parse_slo_flag
from conveyor.bench.measure.gpu_groups import MixedGpuError
from conveyor.bench.measure.rundirs import RunDirError
from conveyor.bench.plan.gpu_catalog import CatalogError, parse_price_items
from conveyor.bench.report.dashboard import (
    MixedRunsError,
    ReportInputs,
    analyze,
    format_csv,
    format_markdown,
    format_terminal,
)
from conveyor.bench.report.write import write_report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dirs", nargs="+", type=pathlib.Path, metavar="RUN_DIR",
                        help="run, sweep or study directories")
    parser.add_argument("--slo", help="objective, e.g. ttft_p95_ms=500,e2e_p95_ms=5000,error_rate=0.01, or a "
                                      "JSON/TOML file (default: the study's)")
    parser.add_argument("--price-per-gpu-hour", type=float,
                        help="USD per GPU-hour for configurations the study does not price (no default: without "
                             "a price the decision ranks by capacity per GPU)")
    parser.add_argument("--price", action="append", default=[], metavar="GPU=USD_PER_HOUR",
                        help="USD per GPU-hour of one GPU the runs recorded, e.g. H100=2.99,H200=3.79 (repeatable, "
                             "or a JSON/TOML file); matched by whole words to summary.json fixed.gpu_name; wins over "
                             "study.json and --price-per-gpu-hour for that GPU's configurations")
    parser.add_argument("--num-gpus", type=int, default=CostModel().num_gpus, help="GPUs per server")
    parser.add_argument("--main-rate", type=float, help="offered rate of the main scenario (req/s)")
    parser.add_argument("--format", choices=["terminal", "markdown", "csv"], default="terminal")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("conveyor-report"),
                        help="where report.html, report.md, dashboard.csv and plots/ go")
    parser.add_argument("--no-html", action="store_true", help="print only; write no files")
    parser.add_argument("--allow-mixed", action="store_true",
                        help="compare runs whose fixed things (model, tokenizer, server version, trace) differ, with "
                             "a warning; a sweep holding runs of two GPUs is split by GPU (never pooled)")


def run(args: argparse.Namespace) -> int:
    try:
        slo = parse_slo_flag(args.slo) if args.slo else None
        price = CostModel(args.price_per_gpu_hour, args.num_gpus, "--price-per-gpu-hour")
        inputs = ReportInputs(tuple(args.run_dirs), slo, price, args.main_rate, args.allow_mixed,
                              parse_price_items(args.price))
        analysis = analyze(inputs)
    except (RunDirError, SLOError, MixedRunsError, MixedGpuError, CatalogError, PriceMatchError) as error:
        print(f"conveyor report: {error}", file=sys.stderr)
        return 2
    render = {"terminal": format_terminal, "markdown": format_markdown, "csv": format_csv}[args.format]
    print(render(analysis))
    if not args.no_html:
        paths = write_report(analysis, args.out)
        print(f"\nReport: {paths['html']} (also {paths['markdown'].name}, {paths['csv'].name}, plots/)",
              file=sys.stderr)
    return 0
