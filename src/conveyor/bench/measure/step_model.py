"""A step-time model fitted to the engine's step log: what one engine step costs, term by term.

Shape (physical, first order): step_time = c0 + c1 * sequences + c2 * prefill_tokens + c3 * decode_tokens
+ c4 * context_tokens + c5 * [the step computes more than one token]. c0 is the per-step cost that does not depend on the batch (reading the weights
once, launching kernels, the scheduler's fixed work); c1 the per-sequence overhead (sampling, input
preparation, one attention program per sequence); c2 and c3 the per-token compute of prefill and decode
tokens (draft tokens count as decode tokens: they are verified in the decode's forward pass); c4 the
attention's read of the KV cache, proportional to the context the step attends over. c5 is what a step of
several token rows pays over a one-token step besides its tokens: on the CPU a single row (a batch-1 decode)
takes gguf_matmul.c's factored one-row kernels while two or more take the tiled path, which packs the rows
and rebuilds each weight per tile, so the step time jumps between one and two decodes (measured on the
embedded model: 7.5 ms at one decode, 12.9 at two, then ~1.6 ms more each); without c5 the fit splits the
jump between c0 and c1 and misprices both sides of it. Where the log has only one kind of step (all of one
row or none, as on a GPU serving batches), c5 cannot be told from c0 and is fixed at 0.

c6 (`per_gemm_step_s`, CPU logs only) is what a step of more than GEMM_STEP_ROWS (32) token rows pays besides
its rows: there the CPU's projections dequantize every weight and run oneDNN's GEMM instead of the block
kernel (model/quantized.py MAX_KERNEL_ROWS), and the layers run as torch modules instead of one C call.
On the embedded model, one thread, a prompt step costs ~57 ms + 2.5 ms a token (24..260 tokens) where a
decode step of 2..8 rows costs ~16 ms + 2.9 ms a row: ~40 ms that only the large steps pay. Without c6,
least squares (which weighs those 250 ms steps most) lent that cost to the terms the decodes share (c5,
c1), pricing two- and three-decode steps 5-12% high (docs/decision.md, issue 36, "What misprices the CPU's
decode steps"). A GPU has no such switch (and its decode batches cross 32 rows), so c6 stays 0 there.

Every coefficient is a cost, so the fit is non-negative least squares (scipy.optimize.nnls): an
unconstrained fit on collinear logs (decode tokens = decode sequences without speculation) trades a
negative term for a larger one and extrapolates badly.

One more cost is measured, not fitted: the engine loop's time between two steps (`between_steps_s`: the step's
outputs handed to the I/O thread, new requests taken in), which no step record's step_time_s contains. A
busy engine's cadence is step_time + that gap, so a simulation that priced steps alone would run fast by it
(on the H100 study, 0.54-0.63 ms after each ~26 ms decode step: 2%, which over a request's hundreds of
decode steps made it end ~0.3 s early, and requests waiting for its blocks start that much early). It is
the median over logged steps of start - the latest earlier step's end (end_s) before it: the median, so
the few gaps where the engine sat idle between bursts do not count. With async scheduling a step's end is
not the next one's start (step N+1 launches before N settles; core/step_log.py), so the gap is measured
from the end of the step settled by the previous engine call, the latest end before the start. A log
written before end_s takes start + step_time as the end and the next step's start, as it always did.

What the fit cannot price is kept as a distribution (`step_spread`): the quantiles of measured / predicted
time over the fitted steps. The mean decides throughput and E2E, but a percentile of the inter-token gaps
depends on the spread too: on the CPU a single-decode step takes ~12 ms and a multi-row one >= 20, about half
the gaps fall in each mode, so ITL p50 lands in the upper tail of the one-decode steps (13-15 ms measured),
where a simulation pricing every one-decode step alike puts it at their price (docs/decision.md, issue 36).

The fit's error is reported on the log it was fitted on: R² and the median and p95 of the per-step
relative error |predicted - measured| / measured; `bench calibrate --held-out` measures the same on other
runs' steps, and `conveyor simulate --validate` the simulation's error per metric on held-out runs.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls

from conveyor.bench.jsonvalue import JSON

TERMS = ("per_step_s", "per_seq_s", "per_prefill_token_s", "per_decode_token_s", "per_context_token_s",
         "per_multi_row_step_s", "per_gemm_step_s")
"""The coefficients' names, in the order of `StepSample.features`."""
OPTIONAL = {"per_multi_row_step_s": 0.0, "per_gemm_step_s": 0.0, "between_steps_s": 0.0}
GEMM_STEP_ROWS = 32
"""Token rows above which a CPU step pays per_gemm_step_s: core/step_time.py prices with the same number
(bench may not import core; tests/core/test_simulate_calibrated.py holds both to MAX_KERNEL_ROWS)."""
"""Terms added after the first calibrations: a file without one reads it as this (the model it was made with)."""


@dataclass(frozen=True)
class StepSample:
    """One logged step, reduced to what the model sees."""

    num_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    """Draft tokens included."""
    num_context_tokens: int
    step_time_s: float

    @property
    def features(self) -> tuple[float, ...]:
        """The regressors, one per coefficient of TERMS (1 for the per-step constant)."""
        rows = self.num_prefill_tokens + self.num_decode_tokens
        return (1.0, float(self.num_seqs), float(self.num_prefill_tokens), float(self.num_decode_tokens),
                float(self.num_context_tokens), 1.0 if rows > 1 else 0.0, 1.0 if rows > GEMM_STEP_ROWS else 0.0)

    @classmethod
    def from_record(cls, row: Mapping[str, JSON]) -> StepSample | None:
        """A step_log.jsonl row (core/step_log.py's StepRecord fields); None for an empty or untimed step."""
        def count(name: str) -> int:
            value = row.get(name, 0)
            return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0

        time_s = row.get("step_time_s")
        if not isinstance(time_s, (int, float)) or not time_s > 0:
            return None
        sample = cls(num_seqs=count("num_prefill_reqs") + count("num_decode_reqs"),
                     num_prefill_tokens=count("num_prefill_tokens"), num_decode_tokens=count("num_decode_tokens"),
                     num_context_tokens=count("num_context_tokens"), step_time_s=float(time_s))
        return sample if sample.num_prefill_tokens + sample.num_decode_tokens > 0 else None


@dataclass(frozen=True)
class StepTimeCoefficients:
    """Seconds per step, and per unit of each batch term (all >= 0)."""

    per_step_s: float
    per_seq_s: float
    per_prefill_token_s: float
    per_decode_token_s: float
    per_context_token_s: float
    per_multi_row_step_s: float = 0.0
    """Added to a step computing more than one token (module docstring); 0 in files from before the term."""
    between_steps_s: float = 0.0
    """The engine loop's time between steps (module docstring): measured, not fitted, so not in TERMS and not
    in `predict_s` (a step record's time); a simulated step costs predict_s + this. 0 in older files."""
    per_gemm_step_s: float = 0.0
    """Added to a step computing more than GEMM_STEP_ROWS tokens (module docstring): fitted on CPU logs only;
    0 in files from before the term. Last, so that positional callers of the fields above keep their meaning."""

    def __post_init__(self) -> None:
        for name in (*TERMS, "between_steps_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0 (got {value})")

    @property
    def values(self) -> tuple[float, ...]:
        return tuple(float(getattr(self, name)) for name in TERMS)

    def predict_s(self, sample: StepSample) -> float:
        return sum(c * x for c, x in zip(self.values, sample.features))

    def to_json(self) -> dict[str, float]:
        return {**dict(zip(TERMS, self.values)), "between_steps_s": self.between_steps_s}

    @classmethod
    def from_json(cls, value: Mapping[str, JSON], where: str) -> StepTimeCoefficients:
        numbers = {name: value.get(name, OPTIONAL.get(name)) for name in (*TERMS, "between_steps_s")}
        bad = [name for name, v in numbers.items() if not isinstance(v, (int, float)) or isinstance(v, bool)]
        if bad:
            raise ValueError(f"{where}: {', '.join(bad)} must be numbers")
        return cls(**{name: float(v) for name, v in numbers.items()})  # type: ignore[arg-type]


@dataclass(frozen=True)
class FitError:
    """How well the coefficients reproduce the steps they were fitted on."""

    num_steps: int
    r2: float
    """Coefficient of determination of step time (1: every step exact)."""
    median_rel_error: float
    """Median over steps of |predicted - measured| / measured."""
    p95_rel_error: float
    """95th percentile of the same."""

    def to_json(self) -> dict[str, float | int]:
        return {"num_steps": self.num_steps, "r2": self.r2, "median_rel_error": self.median_rel_error,
                "p95_rel_error": self.p95_rel_error}

    @classmethod
    def from_json(cls, value: Mapping[str, JSON], where: str) -> FitError:
        fields = {"r2": value.get("r2"), "median_rel_error": value.get("median_rel_error"),
                  "p95_rel_error": value.get("p95_rel_error")}
        steps = value.get("num_steps")
        if not isinstance(steps, int) or any(not isinstance(v, (int, float)) for v in fields.values()):
            raise ValueError(f"{where}: num_steps, r2, median_rel_error and p95_rel_error must be numbers")
        return cls(num_steps=steps, **{k: float(v) for k, v in fields.items()})  # type: ignore[arg-type]


def fit_step_model(samples: Sequence[StepSample], window: int = 1, run_sizes: Sequence[int] | None = None,
                   cpu: bool = False) -> tuple[StepTimeCoefficients, FitError]:
    """Non-negative least squares of step time on the terms, and the fit's error on `samples` (per step).

    `cpu`: the logs are the CPU engine's, whose steps of more than GEMM_STEP_ROWS rows take another path
    (c6, module docstring); otherwise c6 stays 0 and the fit is the one before the term.

    `window` > 1 fits sums of that many consecutive steps of each run (`run_sizes`: how many of `samples`,
    in order, each run gave; default one run): the model is linear, so a window's time is the sum of its
    steps' terms, and time a log puts on the wrong one of two neighbours (an async engine's record spans
    the next step's schedule and launch) cancels inside the window instead of pricing both steps wrong."""
    if len(samples) < len(TERMS) * window:
        raise ValueError(f"a step-time fit needs at least {len(TERMS) * window} logged steps (got {len(samples)})")
    design = np.array([s.features for s in samples], dtype=np.float64)
    times = np.array([s.step_time_s for s in samples], dtype=np.float64)
    for term in ("per_multi_row_step_s", "per_gemm_step_s"):
        column = TERMS.index(term)
        # a step-kind term where the log has one kind of step is c0's twin, fixed at 0; c6 is also 0 off the CPU
        if np.all(design[:, column] == design[0, column]) or (term == "per_gemm_step_s" and not cpu):
            design[:, column] = 0.0
    if window > 1:
        design, times = _window_sums(design, times, run_sizes or [len(samples)], window)
    # Columns span 1 to 1e6 (context tokens): scaled to a max of 1 each, NNLS converges on all of them.
    scale = np.abs(design).max(axis=0)
    scale[scale == 0] = 1.0
    solution, _ = nnls(design / scale, times)
    coefficients = StepTimeCoefficients(**{name: float(c) for name, c in zip(TERMS, solution / scale)})
    return coefficients, fit_error(coefficients, samples)


def _window_sums(design: np.ndarray, times: np.ndarray, run_sizes: Sequence[int],
                 window: int) -> tuple[np.ndarray, np.ndarray]:
    """Each run's consecutive rows summed `window` at a time (a run's last partial window is left out)."""
    if sum(run_sizes) != len(times):
        raise ValueError(f"run sizes {list(run_sizes)} do not add up to the {len(times)} steps")
    rows, sums, start = [], [], 0
    for size in run_sizes:
        used = size // window * window
        rows.append(design[start:start + used].reshape(-1, window, design.shape[1]).sum(axis=1))
        sums.append(times[start:start + used].reshape(-1, window).sum(axis=1))
        start += size
    return np.concatenate(rows), np.concatenate(sums)


def fit_error(coefficients: StepTimeCoefficients, samples: Sequence[StepSample]) -> FitError:
    """R² and relative errors of `coefficients` on `samples` (any log: the fitted one or a held-out one)."""
    if not samples:
        raise ValueError("no logged steps to measure the fit's error on")
    predicted = np.array([coefficients.predict_s(s) for s in samples])
    measured = np.array([s.step_time_s for s in samples])
    residual = float(np.sum((measured - predicted) ** 2))
    total = float(np.sum((measured - measured.mean()) ** 2))
    relative = np.abs(predicted - measured) / measured
    return FitError(num_steps=len(samples), r2=1.0 - residual / total if total > 0 else (1.0 if residual == 0 else 0.0),
                    median_rel_error=float(np.percentile(relative, 50)),
                    p95_rel_error=float(np.percentile(relative, 95)))


def pace(coefficients: StepTimeCoefficients, samples: Sequence[StepSample]) -> float:
    """Summed predicted / summed measured step time of `samples`: 1.0 when a run kept the model's pace on the
    whole, 0.9 when its steps took 11% longer than priced. A step's error averages out here; a host that ran
    a whole run slower or faster does not, and that drift is what a held-out run's latencies inherit."""
    measured = sum(s.step_time_s for s in samples)
    if not samples or measured <= 0:
        raise ValueError("no logged steps to measure the pace of")
    return sum(coefficients.predict_s(s) for s in samples) / measured


SPREAD_POINTS = 21
"""Quantiles kept of the steps' spread: 0, 5, ..., 100%."""


def step_spread(coefficients: StepTimeCoefficients, samples: Sequence[StepSample]) -> tuple[float, ...]:
    """Quantiles (SPREAD_POINTS, evenly spaced) of measured / predicted step time over `samples`, scaled so
    the distribution they interpolate has mean 1: a simulation drawing from it keeps the fitted mean (module
    docstring); () when fewer than two steps are priced above 0."""
    ratios = np.array([s.step_time_s / p for s in samples if (p := coefficients.predict_s(s)) > 0])
    if ratios.size < 2:
        return ()
    quantiles = np.quantile(ratios, np.linspace(0.0, 1.0, SPREAD_POINTS))
    # the mean of a uniform draw mapped through the piecewise-linear quantile function: the trapezoid rule
    mean = (quantiles.sum() - (quantiles[0] + quantiles[-1]) / 2) / (SPREAD_POINTS - 1)
    return tuple(float(q / mean) for q in quantiles)


def between_steps_s(logs: Sequence[Sequence[Mapping[str, JSON]]]) -> float:
    """The median gap before each step of each log (rows in logged order), 0 when no row has a time and a
    start (module docstring)."""
    gaps: list[float] = []
    for rows in logs:
        timed = [(start, time_s, _number(row, "end_s")) for row in rows
                 if (start := _number(row, "start_s")) > 0 and (time_s := _number(row, "step_time_s", -1.0)) >= 0]
        if timed and all(end > 0 for _, _, end in timed):
            gaps += _gaps_before_starts([start for start, _, _ in timed], [end for _, _, end in timed])
        else:  # a log written before end_s: each step ended at start + step_time, the next one starts after
            gaps += [max(0.0, later[0] - start - time_s) for (start, time_s, _), later in itertools.pairwise(timed)]
    return float(np.median(gaps)) if gaps else 0.0


def _gaps_before_starts(starts: Sequence[float], ends: Sequence[float]) -> list[float]:
    """Each start minus the latest end before it among the earlier steps (ends rise in logged order: a step is
    logged when it ends); the first step, with no end before it, has none."""
    gaps = []
    for index, start in enumerate(starts):
        before = bisect.bisect_right(ends, start, 0, index)
        if before:
            gaps.append(start - ends[before - 1])
    return gaps


def _number(row: Mapping[str, JSON], key: str, missing: float = 0.0) -> float:
    value = row.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else missing
