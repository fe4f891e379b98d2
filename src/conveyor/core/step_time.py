"""A calibrated step-time model for the simulation, read from a `conveyor bench calibrate` file.

The fit lives in bench/measure/step_model.py (it needs numpy and scipy); this is its stdlib reader, so
`conveyor simulate` prices each step it schedules by the engine's own measured costs:
step_time = per_step + per_seq * sequences + per_prefill_token * prefill tokens
+ per_decode_token * decode tokens + per_context_token * context tokens + per_multi_row_step when the step
computes more than one token (a one-token step takes the CPU's one-row matmul kernels) + per_gemm_step when it
computes more than GEMM_STEP_ROWS tokens (the CPU's dequantize-and-GEMM path), on the `StepRecord` of the
step (core/step_log.py), the same terms the engine logged; plus between_steps, the engine loop's measured time
between two steps, so that back-to-back simulated steps keep the busy engine's cadence, not just its step times. The file format is bench/measure/calibration.py's;
tests/core/test_simulate_calibrated.py checks that what bench writes, this reads.
"""

from __future__ import annotations

import json
import math
import pathlib
import statistics
from dataclasses import dataclass

from conveyor.core.step_log import StepRecord

TERMS = ("per_step_s", "per_seq_s", "per_prefill_token_s", "per_decode_token_s", "per_context_token_s",
         "per_multi_row_step_s", "per_gemm_step_s", "between_steps_s")
OPTIONAL = {"per_multi_row_step_s": 0.0, "per_gemm_step_s": 0.0, "between_steps_s": 0.0}
"""Terms added after the first calibrations: a file without one reads it as this (the model it was fitted with)."""
GEMM_STEP_ROWS = 32
"""A step of more token rows than this pays per_gemm_step: on the CPU its projections dequantize each weight
and run oneDNN's GEMM (model/quantized.py MAX_KERNEL_ROWS, which a test holds this to), and its layers run as
torch modules instead of one C call (bench/measure/step_model.py says what that costs)."""


@dataclass(frozen=True)
class CalibratedStepTime:
    """Seconds per step from a fitted calibration (every term >= 0)."""

    per_step_s: float
    per_seq_s: float
    per_prefill_token_s: float
    per_decode_token_s: float
    per_context_token_s: float
    per_multi_row_step_s: float = 0.0
    """Added to a step computing more than one token (bench/measure/step_model.py says why)."""
    between_steps_s: float = 0.0
    """Added to every step: the engine loop's time after a step before the next begins (step_model.py)."""
    spread: tuple[float, ...] = ()
    """Quantiles (evenly spaced, ascending, mean 1) of measured / fitted step time; () prices steps exactly."""
    label: str = ""
    """Which calibration: its hardware, model, dtype (printed with the results)."""
    per_gemm_step_s: float = 0.0
    """Added to a step computing more than GEMM_STEP_ROWS tokens (step_model.py); 0 off the CPU. Last, so that
    positional callers of the fields above keep their meaning."""
    front_end_in_s: tuple[float, ...] = ()
    """Quantiles (evenly spaced, ascending, >= 0) of a request's time from send to the scheduler (HTTP,
    tokenizing, the hop to the engine core), fitted by bench/measure/front_end.py; () for none."""
    front_end_out_s: float = 0.0
    """Time from a step's end to its chunk at the client (detokenizing, SSE); 0 for files without it."""

    def __post_init__(self) -> None:
        for name in TERMS:
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"calibration {name} must be a finite number >= 0 (got {value})")
        if self.per_step_s <= 0 and self.per_seq_s <= 0:
            raise ValueError("calibration: a step must cost time (per_step_s or per_seq_s > 0)")
        if len(self.spread) == 1 or any(not (math.isfinite(q) and q > 0) for q in self.spread) \
                or list(self.spread) != sorted(self.spread):
            raise ValueError("calibration step_spread must be two or more ascending numbers > 0")
        if len(self.front_end_in_s) == 1 or list(self.front_end_in_s) != sorted(self.front_end_in_s) \
                or any(not (math.isfinite(d) and d >= 0) for d in self.front_end_in_s) \
                or not (math.isfinite(self.front_end_out_s) and self.front_end_out_s >= 0):
            raise ValueError("calibration front_end: in_delay_s two or more ascending numbers >= 0, out_s >= 0")

    def batch_time_s(self, record: StepRecord) -> float:
        rows = record.num_prefill_tokens + record.num_decode_tokens
        return (self.per_step_s + self.per_seq_s * record.num_reqs
                + self.per_prefill_token_s * record.num_prefill_tokens
                + self.per_decode_token_s * record.num_decode_tokens
                + self.per_context_token_s * record.num_context_tokens
                + (self.per_multi_row_step_s if rows > 1 else 0.0)
                + (self.per_gemm_step_s if rows > GEMM_STEP_ROWS else 0.0)
                + self.between_steps_s)

    def drawn_time_s(self, record: StepRecord, u: float) -> float:
        """The step's time at quantile `u` (0..1) of the spread: the fitted price scaled by the interpolated
        quantile, plus the time between steps (measured, not part of what the spread describes)."""
        fitted = self.batch_time_s(record) - self.between_steps_s
        if not self.spread:
            return self.batch_time_s(record)
        return fitted * _interpolate(self.spread, u) + self.between_steps_s

    def in_delay_s(self, u: float) -> float:
        """A request's way in at quantile `u` (0..1) of the fitted front end; 0 without one."""
        return _interpolate(self.front_end_in_s, u) if self.front_end_in_s else 0.0

    def describe(self) -> str:
        return (f"calibrated ({self.label}): {self.per_step_s * 1e3:.3g} ms + {self.per_seq_s * 1e6:.3g} us/seq + "
                f"{self.per_prefill_token_s * 1e6:.3g} us/prefill token + {self.per_decode_token_s * 1e6:.3g} "
                f"us/decode token + {self.per_context_token_s * 1e9:.3g} ns/context token + "
                f"{self.per_multi_row_step_s * 1e3:.3g} ms/multi-row step + "
                + (f"{self.per_gemm_step_s * 1e3:.3g} ms/GEMM step + " if self.per_gemm_step_s else "")
                + f"{self.between_steps_s * 1e3:.3g} ms between steps"
                + (f"; front end: in {statistics.fmean(self.front_end_in_s) * 1e3:.3g} ms mean, out "
                   f"{self.front_end_out_s * 1e3:.3g} ms" if self.front_end_in_s else ""))


def _interpolate(quantiles: tuple[float, ...], u: float) -> float:
    """The value at `u` (0..1) of evenly spaced quantiles, linear between them."""
    position = min(max(u, 0.0), 1.0) * (len(quantiles) - 1)
    low = min(int(position), len(quantiles) - 2)
    return quantiles[low] + (position - low) * (quantiles[low + 1] - quantiles[low])


def read_calibration(path: str, hardware: str | None = None) -> CalibratedStepTime:
    """The calibration in `path` whose hardware contains `hardware` (the only one when not given)."""
    try:
        data = json.loads(pathlib.Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"--calibration {path}: cannot read it: {error}") from None
    entries = data.get("calibrations") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ValueError(f"--calibration {path}: not a calibration file (conveyor bench calibrate writes one)")
    keys = [e.get("key") if isinstance(e.get("key"), dict) else {} for e in entries]
    chosen = [i for i, key in enumerate(keys) if hardware is None or hardware.lower() in str(key.get("hardware")).lower()]
    if len(chosen) != 1:
        listed = "; ".join(f"{k.get('hardware')} | {k.get('model')} | {k.get('dtype')}" for k in keys) or "none"
        raise ValueError(f"--calibration {path}: {len(chosen)} calibrations match (pass --calibration-hardware "
                         f"to pick one of: {listed})")
    entry, key = entries[chosen[0]], keys[chosen[0]]
    coefficients = entry.get("coefficients")
    values = {name: coefficients.get(name, OPTIONAL.get(name)) if isinstance(coefficients, dict) else None
              for name in TERMS}
    numbers = {name: float(v) for name, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if len(numbers) != len(TERMS):
        raise ValueError(f"--calibration {path}: coefficients {', '.join(TERMS)} must be numbers")
    label = f"{key.get('hardware')} | {key.get('model')} | {key.get('dtype')}"
    spread = entry.get("step_spread", [])
    if not isinstance(spread, list) or not all(isinstance(q, (int, float)) and not isinstance(q, bool) for q in spread):
        raise ValueError(f"--calibration {path}: step_spread must be a list of numbers")
    delays, out_s = _front_end(entry.get("front_end"), path)
    return CalibratedStepTime(**numbers, spread=tuple(float(q) for q in spread), label=label,
                              front_end_in_s=delays, front_end_out_s=out_s)


def _front_end(value: object, path: str) -> tuple[tuple[float, ...], float]:
    """The entry's fitted front end (bench/measure/front_end.py): in-delay quantiles, out; none in older files."""
    if value is None:
        return (), 0.0
    delays = value.get("in_delay_s") if isinstance(value, dict) else None
    out = value.get("out_s") if isinstance(value, dict) else None
    if not isinstance(delays, list) or not all(isinstance(d, (int, float)) and not isinstance(d, bool) for d in delays) \
            or not isinstance(out, (int, float)) or isinstance(out, bool):
        raise ValueError(f"--calibration {path}: front_end needs in_delay_s (numbers) and out_s (a number)")
    return tuple(float(d) for d in delays), float(out)
