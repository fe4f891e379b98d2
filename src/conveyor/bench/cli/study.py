"""`conveyor bench study [STUDY_FILE]`: a baseline server configuration and one-parameter variants, each
launched, health-checked, warmed up, swept (or run at fixed --rates) and stopped; then the dashboard,
recommendation, checklist and diagnosis, and the HTML report in OUT/report/.

The study is a JSON/TOML file (see docs/decision.md) or flags; flags override the file. Example:
  conveyor bench study --command 'conveyor serve --port {port} {args}' --trace t.jsonl \\
      --slo ttft_p95_ms=2000,error_rate=0.01 --baseline max_num_seqs=8 \\
      --variant static:batching=static --variant budget:max_num_batched_tokens=256 --rates 0.5,1,2
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Any

from conveyor.bench.cli.sweep import (
    add_run_option_arguments,
    add_sweep_arguments,
    counting,
    estimated_runs,
    run_options_from_args,
    sweep_options_from_args,
)
from conveyor.bench.decide.slo import SLOError, parse_slo_flag
from conveyor.bench.decide.study import StudyError, run_study, spec_from_mapping
from conveyor.bench.decide.run_fn import RunTemplate, make_run_fn
from conveyor.bench.decide.sweep import SweepError
from conveyor.bench.jsonvalue import Fields
from conveyor.bench.load.launch import LaunchError
from conveyor.bench.load.progress import ProgressReporter
from conveyor.bench.measure.rundirs import RunDirError, prepare_out_dir
from conveyor.bench.report.dashboard import MixedRunsError, ReportInputs, analyze, format_terminal
from conveyor.bench.report.write import write_report
from conveyor.bench.table_file import read_table_file


def parse_value(text: str) -> Any:
    """'8' -> 8, '0.5' -> 0.5, 'true'/'false' -> bool, anything else stays a string."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()


def parse_assignments(text: str, flag: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise StudyError(f"{flag}: expected KEY=VALUE, got {item!r}")
        out[key.strip().replace("-", "_")] = parse_value(value)
    return out


def parse_variant(text: str) -> dict[str, Any]:
    name, sep, rest = text.partition(":")
    if not sep:
        raise StudyError(f"--variant: expected NAME:KEY=VALUE, got {text!r}")
    return {"name": name, **parse_assignments(rest, "--variant")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("study_file", nargs="?", type=pathlib.Path, help="JSON or TOML study file")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("conveyor-study"))
    # dest differs from the flag: `command` is the top-level dispatcher's subcommand attribute.
    parser.add_argument("--command", dest="server_command", help="server command template with {port} {host} {args}")
    parser.add_argument("--trace", help="trace file")
    parser.add_argument("--slo", help="objective (KEY=VALUE,... or a JSON/TOML file)")
    parser.add_argument("--baseline", help="baseline engine flags, e.g. max_num_seqs=8,enable_chunked_prefill=true")
    parser.add_argument("--variant", action="append", default=[], help="NAME:KEY=VALUE, one parameter (repeatable)")
    parser.add_argument("--rates", help="fixed offered rates, e.g. 0.5,1,2 (instead of a search)")
    parser.add_argument("--main-rate", type=float, help="offered rate of the main scenario")
    parser.add_argument("--price-per-gpu-hour", type=float, help="USD per GPU-hour (no default: without a price the decision ranks by capacity per GPU)")
    parser.add_argument("--num-gpus", type=int, help="GPUs per server")
    parser.add_argument("--planned-context-len", type=int,
                        help="context length (prompt + output tokens) the deployment plans for (checklist Q3)")
    parser.add_argument("--force", action="store_true", help="replace an existing study in --out")
    parser.add_argument("--reverse-order", action="store_true",
                        help="run the configurations last to first (the recommendation should not change)")
    add_sweep_arguments(parser)
    add_run_option_arguments(parser)


def _load_file(path: pathlib.Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    if not path.is_file():
        raise StudyError(f"study file {path} does not exist")
    return dict(read_table_file(path))


def study_mapping(args: argparse.Namespace) -> dict[str, Any]:
    """The study file's mapping with every given flag applied over it."""
    data = _load_file(args.study_file)
    if args.server_command is not None:
        data["command"] = args.server_command
    for key in ("trace", "main_rate", "price_per_gpu_hour", "num_gpus", "planned_context_len"):
        if getattr(args, key) is not None:
            data[key] = getattr(args, key)
    if args.slo:
        data["slo"] = parse_slo_flag(args.slo).to_dict()
    if args.baseline:
        data["baseline"] = parse_assignments(args.baseline, "--baseline")
    if args.variant:
        data["variants"] = [parse_variant(v) for v in args.variant]
    tables = Fields.of(data, str(args.study_file or "flags"))  # the file's [sweep] and [run], under the flags
    sweep: dict[str, Any] = {**tables.child("sweep").data, **sweep_options_from_args(args)}
    if args.rates:
        sweep["rates"] = [float(r) for r in args.rates.split(",") if r.strip()]
    data["sweep"] = sweep
    data["run"] = {**tables.child("run").data, **run_options_from_args(args)}
    return data


def run(args: argparse.Namespace) -> int:
    try:
        spec = spec_from_mapping(study_mapping(args), str(args.study_file or "flags"))
        prepare_out_dir(args.out, args.force)
        num_rates = len(spec.rates) if spec.rates else None
        reporter = ProgressReporter(len(spec.variants) * estimated_runs(spec.sweep, num_rates))

        def run_fn_factory(template: RunTemplate) -> Any:
            return counting(make_run_fn(template), reporter)

        out = run_study(spec, args.out, run_fn_factory=run_fn_factory, progress=reporter,
                        reverse_order=args.reverse_order)
        reporter.close()
        analysis = analyze(ReportInputs((out,)))
    except (StudyError, SLOError, SweepError, LaunchError, RunDirError, MixedRunsError, ValueError) as error:
        print(f"conveyor bench study: {error}", file=sys.stderr)
        return 2
    print(format_terminal(analysis))
    paths = write_report(analysis, out / "report")
    print(f"\nReport: {paths['html']}")
    return 0
