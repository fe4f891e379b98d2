"""`conveyor bench calibrate RUN_DIR... --out calib.json`: fit a step-time model to runs' step logs.

`--step-log FILE... --hardware TEXT --model TEXT` fits bare step logs instead: a server driven by another
client (`vllm bench serve`, GuideLLM, AIPerf), its log drained from GET /step_log; the key the run
directory's summary.json would give is given by hand (calibration.calibrate_step_logs).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from dataclasses import replace

from conveyor.bench.measure.calibration import (
    COST_FLAGS,
    STEP_LOG_FIELDS,
    Calibration,
    CalibrationError,
    CalibrationKey,
    calibrate,
    calibrate_step_logs,
    run_paces,
    write_calibration,
)
from conveyor.bench.measure.front_end import FrontEndError, fit_front_end, read_front_end_run
from conveyor.bench.measure.step_log import read_step_log_file
from conveyor.bench.measure.step_model import TERMS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dirs", nargs="*", metavar="RUN_DIR",
                        help="run directories with step_log.jsonl (bench run --collect-step-log), one server setup")
    parser.add_argument("--held-out", nargs="+", default=[], metavar="RUN_DIR",
                        help="runs of the same setup not fitted on: the model's error on their steps is reported too")
    logs = parser.add_argument_group("bare step logs (another client drove the server; no run directory)")
    logs.add_argument("--step-log", nargs="+", default=[], metavar="FILE",
                      help="step logs to fit instead of run directories: JSONL (or .jsonl.gz) of the records GET "
                           f"/step_log returns (serve --step-log-size N), one server setup; each record needs "
                           f"{', '.join(STEP_LOG_FIELDS)}, and start_s, end_s to measure the time between steps")
    logs.add_argument("--held-out-step-log", nargs="+", default=[], metavar="FILE",
                      help="step logs of the same setup not fitted on (the model's error on them is reported)")
    logs.add_argument("--hardware", metavar="TEXT",
                      help="with --step-log: the GPU name and count as a run would record it "
                           "(\"NVIDIA H100 80GB HBM3 x1\"), or cpu; `simulate --calibration-hardware` picks by it")
    logs.add_argument("--model", metavar="TEXT", help="with --step-log: the served model (name, weights)")
    logs.add_argument("--dtype", default="unknown", help="with --step-log: the weights' dtype (default unknown)")
    logs.add_argument("--server-flag", action="append", default=[], metavar="KEY=VALUE",
                      help="with --step-log, repeatable: a server flag that changes a step's cost, as the key "
                           f"records it ({', '.join(COST_FLAGS)}); async_scheduling=true sets the default "
                           "--fit-window")
    parser.add_argument("--fit-window", type=int, default=None, metavar="K",
                        help="fit sums of K consecutive steps of each log; K > 1 stops an async engine's log, "
                             "whose records can carry part of the next step's time, from mispricing both "
                             "neighbours (default: 8 for runs served with async scheduling, else 1: each step)")
    parser.add_argument("--front-end", nargs=3, action="append", default=[],
                        metavar=("STEP_LOG", "TRACE", "CLIENT_JSON"),
                        help="repeatable: fit the front end's share of TTFT (bench/measure/front_end.py) from a run's "
                             "step log, the trace it sent and the client's result JSON (its mean_ttft_ms)")
    parser.add_argument("--out", required=True,
                        help="calibration file to write; an entry with the same key is replaced, others kept")


def run(args: argparse.Namespace) -> int:
    try:
        if args.fit_window is not None and args.fit_window < 1:
            raise CalibrationError(f"--fit-window must be >= 1 (got {args.fit_window})")
        calibration = _with_front_end(_calibration(args), args.front_end)
        write_calibration(pathlib.Path(args.out), calibration)
        paces = describe_paces(calibration)
    except CalibrationError as error:
        print(f"conveyor bench calibrate: error: {error}", file=sys.stderr)
        return 2
    print(describe(calibration))
    print(paces)
    print(f"written to {args.out}")
    return 0


def _calibration(args: argparse.Namespace) -> Calibration:
    """The fit the flags ask for: of run directories, or of bare step logs under a key given by hand."""
    paths = [pathlib.Path(p) for p in args.step_log]
    if not paths:
        given = [flag for flag, value in (("--hardware", args.hardware), ("--model", args.model),
                                          ("--held-out-step-log", args.held_out_step_log),
                                          ("--server-flag", args.server_flag)) if value]
        if given:
            raise CalibrationError(f"{given[0]} goes with --step-log (a run directory's key is in its summary.json)")
        if not args.run_dirs:
            raise CalibrationError("give RUN_DIR... or --step-log FILE...")
        return calibrate([pathlib.Path(d) for d in args.run_dirs], [pathlib.Path(d) for d in args.held_out],
                         args.fit_window)
    if args.run_dirs or args.held_out:
        raise CalibrationError("--step-log fits bare logs: give run directories (and --held-out) or --step-log "
                               "(and --held-out-step-log), not both")
    if not args.hardware or not args.model:
        raise CalibrationError(f"--step-log needs {'--hardware' if not args.hardware else '--model'} TEXT "
                               "(a bare log does not say what served it)")
    key = CalibrationKey.from_flags(args.hardware, args.model, args.dtype, _server_flags(args.server_flag))
    return calibrate_step_logs(key, paths, [pathlib.Path(p) for p in args.held_out_step_log], args.fit_window)


def _with_front_end(calibration: Calibration, given: list[list[str]]) -> Calibration:
    """The calibration with its front end fitted from each --front-end STEP_LOG TRACE CLIENT_JSON."""
    if not given:
        return calibration
    async_scheduling = dict(calibration.key.configuration).get("async_scheduling", "").lower() == "true"
    try:
        runs = [read_front_end_run(read_step_log_file(pathlib.Path(log)), pathlib.Path(trace), pathlib.Path(client),
                                   async_scheduling) for log, trace, client in given]
        return replace(calibration, front_end=fit_front_end(runs))
    except (FrontEndError, OSError, ValueError) as error:
        raise CalibrationError(f"--front-end: {error}") from None


def _server_flags(given: list[str]) -> dict[str, str]:
    """--server-flag KEY=VALUE pairs, each KEY one of COST_FLAGS."""
    flags = {}
    for pair in given:
        key, sep, value = pair.partition("=")
        if not sep or key not in COST_FLAGS:
            raise CalibrationError(f"--server-flag {pair}: expected KEY=VALUE with KEY one of {', '.join(COST_FLAGS)}")
        flags[key] = value
    return flags


def describe(calibration: Calibration) -> str:
    """The key, the coefficients in readable units, and the fit's error."""
    key, fit, held_out = calibration.key, calibration.fit, calibration.held_out
    units = {"per_step_s": ("ms", 1e3), "per_seq_s": ("us", 1e6), "per_prefill_token_s": ("us", 1e6),
             "per_decode_token_s": ("us", 1e6), "per_context_token_s": ("ns", 1e9), "per_multi_row_step_s": ("ms", 1e3),
             "per_gemm_step_s": ("ms", 1e3)}
    terms = [f"{name.removesuffix('_s')} = {value * units[name][1]:.4g} {units[name][0]}"
             for name, value in zip(TERMS, calibration.coefficients.values)]
    window = f" (sums of {calibration.fit_window})" if calibration.fit_window > 1 else ""
    terms.append(f"then between steps {calibration.coefficients.between_steps_s * 1e3:.4g} ms (measured)")
    lines = [f"{key.hardware} | {key.model} | {key.dtype} | " + " ".join(f"{k}={v}" for k, v in key.configuration),
             "step time = " + ", ".join(terms),
             f"fit on {fit.num_steps} steps{window}: R² {fit.r2:.3f}, relative error median {fit.median_rel_error:.1%}, "
             f"p95 {fit.p95_rel_error:.1%}"]
    if held_out is not None:
        lines.append(f"held out, {held_out.num_steps} steps of {len(calibration.held_out_runs)} run(s): R² "
                     f"{held_out.r2:.3f}, relative error median {held_out.median_rel_error:.1%}, "
                     f"p95 {held_out.p95_rel_error:.1%}")
    if calibration.front_end is not None:
        front = calibration.front_end
        lines.append(f"front end, {front.num_requests} requests: in {sum(front.in_delay_s) / len(front.in_delay_s) * 1e3:.3g} "
                     f"ms mean (p90 {front.in_delay_s[round(0.9 * (len(front.in_delay_s) - 1))] * 1e3:.3g} ms), "
                     f"out {front.out_s * 1e3:.3g} ms")
    return "\n".join(lines)


def describe_paces(calibration: Calibration) -> str:
    """Each run's summed predicted / measured step time, fitted runs then held-out ones: a held-out run far
    from 1 ran at another pace than the fit (the host drifted), and its simulated latencies inherit that."""
    def listed(runs: tuple[str, ...]) -> str:
        paces = run_paces(calibration.coefficients, [pathlib.Path(r) for r in runs])
        return ", ".join(f"{pathlib.Path(run).name} {value:.3f}" for run, value in paces)

    line = f"pace (predicted / measured step time, summed per run): fitted {listed(calibration.runs)}"
    return line + (f"; held out {listed(calibration.held_out_runs)}" if calibration.held_out_runs else "")
