"""issue 36: how a calibration prices each kind of CPU step, on its fitted and its held-out runs.

usage: python step_classes.py CALIB.json [CALIB.json...]  (PYTHONPATH=src; one row per file and run set)
Per class, summed measured / summed predicted step time, then the median of the per-step ratio: 1.000 is
priced right on the whole, 0.90 priced 11% high. Classes: decode-only steps of 1, 2, 3 and 4+ rows; a prompt
step alone ("prompt"); a prompt step with decodes riding along ("prompt+dec")."""

import json
import pathlib
import sys

import numpy as np

from conveyor.bench.measure.step_log import read_step_log
from conveyor.bench.measure.step_model import StepSample, StepTimeCoefficients

CLASSES = ["dec1", "dec2", "dec3", "dec4+", "prompt", "prompt+dec", "all"]


def step_class(s: StepSample) -> str:
    if s.num_prefill_tokens:
        return "prompt" if s.num_seqs == 1 else "prompt+dec"
    return f"dec{s.num_decode_tokens}" if s.num_decode_tokens < 4 else "dec4+"


def ratios(coefficients: StepTimeCoefficients, runs: list[str]) -> dict[str, str]:
    pairs: dict[str, list[tuple[float, float]]] = {}
    for run in runs:
        for s in map(StepSample.from_record, read_step_log(pathlib.Path(run))):
            if s is not None:
                for c in (step_class(s), "all"):
                    pairs.setdefault(c, []).append((s.step_time_s, coefficients.predict_s(s)))
    return {c: f"{sum(m for m, _ in v) / sum(p for _, p in v):.3f} ({np.median([m / p for m, p in v]):.3f})"
            for c, v in pairs.items()}


if __name__ == "__main__":
    print("| calibration | steps | " + " | ".join(CLASSES) + " |\n" + "|---" * (len(CLASSES) + 2) + "|")
    for path in sys.argv[1:]:
        entry = json.loads(pathlib.Path(path).read_text())["calibrations"][0]
        coefficients = StepTimeCoefficients.from_json(entry["coefficients"], path)
        for which in ("runs", "held_out_runs"):
            r = ratios(coefficients, entry.get(which, []))
            print(f"| {path} | {which.removesuffix('_runs')} | " + " | ".join(r.get(c, "") for c in CLASSES) + " |")
