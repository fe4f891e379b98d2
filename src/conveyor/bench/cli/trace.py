"""`conveyor trace make | import | show`: build, import/anonymize and inspect request traces."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from typing import Any

import numpy as np

from conveyor.bench.jsonvalue import Fields
from conveyor.bench.trace.arrivals import ArrivalConfig, ArrivalProcess
from conveyor.bench.trace.model_len import fit_config, fit_trace
from conveyor.bench.trace.tokenize_lengths import with_exact_lengths
from conveyor.bench.trace.trace_gen import CLASSES, TraceMakeConfig, make_mixed_trace
from conveyor.bench.trace.trace_import import ImportConfig, ImportFormat, Turns, import_trace
from conveyor.bench.trace.trace_synthetic import RandomParams
from conveyor.bench.trace.traces import Trace, TraceError, dispatch_units, make_trace, read_trace, write_trace


def parse_mix(text: str) -> dict[str, float]:
    """`chat=0.6,long=0.2,agent=0.2` -> {class: share}; errors name --mix."""
    mix: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or name not in CLASSES:
            raise ValueError(f"--mix: {part!r} must be CLASS=SHARE with CLASS one of {', '.join(CLASSES)}")
        try:
            mix[name] = float(value)
        except ValueError as exc:
            raise ValueError(f"--mix: share {value!r} of {name} is not a number") from exc
        if mix[name] < 0:
            raise ValueError(f"--mix: share of {name} must be >= 0")
    if not mix or sum(mix.values()) <= 0:
        raise ValueError("--mix needs at least one class with a positive share")
    return mix


def apply_params(cfg: TraceMakeConfig, params: list[str]) -> TraceMakeConfig:
    """`--param long.prompt_len_max=1000`: override one field of a class's parameter dataclass."""
    for item in params:
        key, sep, value = item.partition("=")
        klass, _, name = key.partition(".")
        if not sep or klass not in CLASSES:
            raise ValueError(f"--param {item!r} must be CLASS.FIELD=VALUE with CLASS one of {', '.join(CLASSES)}")
        current = getattr(cfg, klass)
        fields = {f.name: f for f in dataclasses.fields(current)}
        if name not in fields:
            raise ValueError(f"--param {item!r}: {klass} has no field {name!r} (fields: {', '.join(fields)})")
        kind = type(getattr(current, name))
        try:
            new = dataclasses.replace(current, **{name: kind(value)})
        except ValueError as exc:
            raise ValueError(f"--param {item!r}: {value!r} is not a {kind.__name__}") from exc
        cfg = dataclasses.replace(cfg, **{klass: new})
    return cfg


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="trace_command", metavar="ACTION", required=True)
    make = sub.add_parser("make", help="Generate a synthetic chat/long/agent trace")
    make.add_argument("--mix", default="chat=0.6,long=0.2,agent=0.2", help="class shares, e.g. chat=0.6,long=0.2,agent=0.2")
    make.add_argument("--num-requests", type=int, default=None, help="number of requests (default 100)")
    make.add_argument("--duration", type=float, default=None, help="seconds of arrivals instead of a count (needs --rate)")
    make.add_argument("--rate", type=float, default=None, help="stamp arrival_s at this mean req/s (default: untimed)")
    make.add_argument("--arrival", default="poisson", choices=["poisson", "gamma", "constant"])
    make.add_argument("--burstiness", type=float, default=1.0, help="gamma shape k (gap CV = 1/sqrt(k))")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--param", action="append", default=[], metavar="CLASS.FIELD=VALUE",
                      help="override a class parameter, e.g. long.prompt_len_max=1000 (repeatable)")
    make.add_argument("--out", required=True, help="trace file to write")
    _add_tokenize_flags(make)
    imp = sub.add_parser("import", help="Turn a request log, dataset file or trace into a conveyor trace")
    _add_import_arguments(imp)
    show = sub.add_parser("show", help="Summarize a trace")
    show.add_argument("trace")


def _add_import_arguments(imp: argparse.ArgumentParser) -> None:
    imp.add_argument("log", nargs="?", default=None,
                     help="input file (none for --format random); log: JSONL of timestamp, prompt|messages, output_tokens")
    imp.add_argument("--format", default=ImportFormat.LOG.value, choices=[f.value for f in ImportFormat],
                     help="log (conveyor's JSONL), openai-log, sharegpt, hf (JSON/JSONL/Parquet export), "
                          "mooncake, random (vLLM's)")
    imp.add_argument("--anonymize", action="store_true", help="replace all text, keep lengths and prefix sharing")
    imp.add_argument("--default-class", default="imported")
    imp.add_argument("--seed", type=int, default=0)
    imp.add_argument("--tokenizer", default=None, metavar="PATH",
                     help="tokenizer.json, model directory or .gguf: exact token lengths (default: words ≈ tokens)")
    imp.add_argument("--num-requests", type=int, default=None, help="keep the first N (random: make N, default 1000)")
    imp.add_argument("--output-len", type=int, default=None, help="fixed output length (default: the file's answers)")
    imp.add_argument("--turns", default=Turns.FIRST.value, choices=[t.value for t in Turns],
                     help="sharegpt/hf conversations: first human message (vLLM) or all, as session turns")
    imp.add_argument("--prompt-column", default=None, help="hf: prompt column (default: detected)")
    imp.add_argument("--answer-column", default=None, help="hf: reference-answer column (default: detected)")
    imp.add_argument("--block-size", type=int, default=512, help="mooncake: tokens per hash id (default 512)")
    d = RandomParams.__dataclass_fields__
    for name in ("input_len", "output_len", "range_ratio", "prefix_len"):
        imp.add_argument(f"--random-{name.replace('_', '-')}", type=type(d[name].default), default=d[name].default,
                         help=f"random: vLLM's --random-{name.replace('_', '-')} (default {d[name].default})")
    imp.add_argument("--out", required=True)
    _add_tokenize_flags(imp)


def _import_config(args: argparse.Namespace) -> ImportConfig:
    random = RandomParams(input_len=args.random_input_len, output_len=args.random_output_len,
                          range_ratio=args.random_range_ratio, prefix_len=args.random_prefix_len)
    return ImportConfig(log_path=args.log, format=ImportFormat(args.format), anonymize=args.anonymize,
                        default_class=args.default_class, seed=args.seed, tokenizer_path=args.tokenizer,
                        output_len=args.output_len, turns=Turns(args.turns), prompt_column=args.prompt_column,
                        answer_column=args.answer_column, num_requests=args.num_requests,
                        block_size=args.block_size, random=random)


def _add_tokenize_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-model-len", type=int, default=None, metavar="N",
                        help="the target server's max_model_len: every request's prompt + output (a session turn "
                             "with its history) fits in N tokens (conveyor serve's default is 2048; default: no bound)")
    parser.add_argument("--tokenize-url", default=None, metavar="BASE_URL",
                        help="count prompt tokens exactly with this server's /tokenize (default: words ≈ tokens)")
    parser.add_argument("--tokenize-model", default=None, help="model name for /tokenize (if the server needs one)")


def _exact(trace: Trace, args: argparse.Namespace) -> Trace:
    if args.tokenize_url is None:
        return trace
    requests = with_exact_lengths(trace.requests, args.tokenize_url, args.tokenize_model)
    generator = dict(trace.header.generator, prompt_len="/tokenize of " + args.tokenize_url)
    return make_trace(requests, seed=trace.header.seed, generator=generator)


def _make_config(args: argparse.Namespace) -> TraceMakeConfig:
    if args.num_requests is not None and args.duration is not None:
        raise ValueError("give --num-requests or --duration, not both")
    arrival = None
    if args.rate is not None:
        arrival = ArrivalConfig(process=ArrivalProcess(args.arrival), request_rate=args.rate,
                                burstiness=args.burstiness, seed=args.seed)
    elif args.duration is not None:
        raise ValueError("--duration needs --rate")
    num = args.num_requests if args.num_requests is not None or args.duration is not None else 100
    cfg = TraceMakeConfig(mix=parse_mix(args.mix), num_requests=num, duration_s=args.duration, seed=args.seed,
                          arrival=arrival)
    cfg = apply_params(cfg, args.param)
    return cfg if args.max_model_len is None else fit_config(cfg, args.max_model_len)


def _quantiles(values: list[float]) -> str:
    if not values:
        return "-"
    p50, p95, top = np.percentile(values, [50, 95, 100])
    return f"p50 {p50:.0f} p95 {p95:.0f} max {top:.0f}"


def describe(trace: Trace) -> str:
    h = trace.header
    lines = [f"conveyor-trace v{h.format_version}  version {h.version[:16]}  {h.num_requests} requests  "
             f"seed {h.seed}  generator {Fields(h.generator, 'generator').text('name', '?')}"]
    stamps = [r.arrival_s for r in trace.requests if r.arrival_s is not None]
    if stamps:
        span = max(stamps) - min(stamps)
        rate = (len(stamps) - 1) / span if span > 0 else math.inf
        lines.append(f"arrivals: {span:.1f} s span, {rate:.2f} req/s mean")
    turns = [len(u) for u in dispatch_units(trace.requests) if u[0].turn is not None]
    if turns:
        lines.append(f"sessions: {len(turns)}, {sum(turns)} turns, {sum(turns) / len(turns):.1f} per session "
                     f"(max {max(turns)})")
    for c in sorted(h.classes):
        rs = [r for r in trace.requests if r.request_class == c]
        cancels = sum(r.cancel_after_s is not None or r.cancel_after_tokens is not None for r in rs)
        groups = {r.prefix_group for r in rs if r.prefix_group}
        lines.append(f"  {c:10s} n={len(rs):5d}  prompt {_quantiles([r.prompt_len for r in rs])}  "
                     f"output {_quantiles([r.output_len for r in rs])}  cancels {cancels}  prefix groups {len(groups)}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        return _dispatch(args)
    except (ValueError, TraceError, OSError) as exc:
        print(f"conveyor trace {args.trace_command}: error: {exc}", file=sys.stderr)
        return 2


def _dispatch(args: argparse.Namespace) -> int:
    trace: Any
    if args.trace_command == "make":
        trace = make_mixed_trace(_make_config(args))
    elif args.trace_command == "import":
        trace = import_trace(_import_config(args))
    else:
        print(describe(read_trace(args.trace)))
        return 0
    trace = _exact(trace, args)
    if args.max_model_len is not None:
        trace, report = fit_trace(trace, args.max_model_len)
        print(report.describe())
    write_trace(trace, args.out)
    print(f"wrote {args.out}: {trace.header.num_requests} requests, version {trace.header.version[:16]}")
    print(describe(trace))
    return 0
