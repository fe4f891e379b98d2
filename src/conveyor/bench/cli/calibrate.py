"""`conveyor bench calibrate RUN_DIR... --out calib.json`: fit a step-time model to runs' step logs."""

from __future__ import annotations

import argparse
import pathlib
import sys

from conveyor.bench.measure.calibration import (
    Calibration,
    CalibrationError,
    calibrate,
    run_paces,
    write_calibration,
)
from conveyor.bench.measure.step_model import TERMS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="run directories with step_log.jsonl (bench run --collect-step-log), one server setup")
    parser.add_argument("--held-out", nargs="+", default=[], metavar="RUN_DIR",
                        help="runs of the same setup not fitted on: the model's error on their steps is reported too")
    parser.add_argument("--fit-window", type=int, default=None, metavar="K",
                        help="fit sums of K consecutive steps of each log; K > 1 stops an async engine's log, "
                             "whose records can carry part of the next step's time, from mispricing both "
                             "neighbours (default: 8 for runs served with async scheduling, else 1: each step)")
    parser.add_argument("--out", required=True,
                        help="calibration file to write; an entry with the same key is replaced, others kept")


def run(args: argparse.Namespace) -> int:
    try:
        if args.fit_window is not None and args.fit_window < 1:
            raise CalibrationError(f"--fit-window must be >= 1 (got {args.fit_window})")
        calibration = calibrate([pathlib.Path(d) for d in args.run_dirs], [pathlib.Path(d) for d in args.held_out],
                                args.fit_window)
        write_calibration(pathlib.Path(args.out), calibration)
        paces = describe_paces(calibration)
    except CalibrationError as error:
        print(f"conveyor bench calibrate: error: {error}", file=sys.stderr)
        return 2
    print(describe(calibration))
    print(paces)
    print(f"written to {args.out}")
    return 0


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
    return "\n".join(lines)


def describe_paces(calibration: Calibration) -> str:
    """Each run's summed predicted / measured step time, fitted runs then held-out ones: a held-out run far
    from 1 ran at another pace than the fit (the host drifted), and its simulated latencies inherit that."""
    def listed(runs: tuple[str, ...]) -> str:
        paces = run_paces(calibration.coefficients, [pathlib.Path(r) for r in runs])
        return ", ".join(f"{pathlib.Path(run).name} {value:.3f}" for run, value in paces)

    line = f"pace (predicted / measured step time, summed per run): fitted {listed(calibration.runs)}"
    return line + (f"; held out {listed(calibration.held_out_runs)}" if calibration.held_out_runs else "")
