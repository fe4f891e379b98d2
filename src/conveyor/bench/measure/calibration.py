"""Calibration files: fitted step-time models keyed by (hardware, model, dtype, configuration).

A step-time model holds for one GPU type and count, one model's weights, one dtype and the engine
settings that change a step's cost (tensor parallelism, quantization, CUDA graphs, async scheduling, CPU
threads, block size, speculative decoding). Scheduler limits (max_num_seqs, max_num_batched_tokens, the
policy) are not part of the key: they change which batches form, not what a given batch costs, and
they are what a simulation varies. The key is read from each run directory's summary.json `fixed`
(bench/measure/fixed.py), so runs that disagree on it cannot be fitted together by mistake.

Step logs without a run directory (a server driven by another client: `vllm bench serve`, GuideLLM, AIPerf,
its log drained from GET /step_log) are fitted by `calibrate_step_logs`, the key given by the caller
(`bench calibrate --step-log FILE --hardware TEXT --model TEXT`): nothing in a bare log says what served it.

File: {"schema_version": 1, "calibrations": [entry, ...]}; writing an entry replaces the one with the
same key and keeps the others, so one file can hold a laptop's and an H100's calibrations side by side.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from conveyor.bench.jsonvalue import JSON, Fields
from conveyor.bench.measure.front_end import FrontEnd
from conveyor.bench.measure.rundirs import RunDirError, load_run
from conveyor.bench.measure.step_log import STEP_LOG_FILE, read_step_log, read_step_log_file
from conveyor.bench.measure.step_model import (
    FitError,
    StepSample,
    StepTimeCoefficients,
    between_steps_s,
    fit_error,
    fit_step_model,
    pace,
    step_spread,
)

CALIBRATION_SCHEMA_VERSION = 1
COST_FLAGS = ("device", "tensor_parallel_size", "quantization", "enforce_eager", "cudagraph_mode",
              "async_scheduling", "num_threads", "block_size", "speculative_config", "kv_cache_dtype")
"""Server flags (summary.json fixed.server_flags) that change what one batch costs: part of the key (an
FP8 KV cache halves the bytes a decode reads)."""
_KEY_DEFAULTS = {"kv_cache_dtype": "auto"}
"""Flags left out of the key at these values: runs recorded before the flag existed did not report it,
and their calibrations must still match runs at its default."""


class CalibrationError(ValueError):
    """Run directories that cannot be calibrated (no step log, different keys), or a bad calibration file."""


@dataclass(frozen=True)
class CalibrationKey:
    """What a step-time model holds for."""

    hardware: str
    """GPU name and count ("NVIDIA H100 80GB HBM3 x1"), or "cpu"."""
    model: str
    """The served model's name and its weights' SHA-256 prefix."""
    dtype: str
    configuration: tuple[tuple[str, str], ...]
    """The COST_FLAGS the server reported, sorted (a tuple of pairs: the key stays hashable and frozen)."""

    def to_json(self) -> dict[str, JSON]:
        return {"hardware": self.hardware, "model": self.model, "dtype": self.dtype,
                "configuration": dict(self.configuration)}

    @classmethod
    def from_json(cls, value: Mapping[str, JSON], where: str) -> CalibrationKey:
        config, hardware, model, dtype = (value.get(n) for n in ("configuration", "hardware", "model", "dtype"))
        if not (isinstance(hardware, str) and isinstance(model, str) and isinstance(dtype, str)
                and isinstance(config, dict)):
            raise CalibrationError(f"{where}: hardware, model and dtype must be strings, configuration an object")
        return cls(hardware, model, dtype, tuple(sorted((str(k), str(v)) for k, v in config.items())))

    @classmethod
    def from_fixed(cls, fixed: Mapping[str, JSON]) -> CalibrationKey:
        """The key of a run, from its summary.json `fixed` (unknown values spelled "unknown")."""
        f = Fields(dict(fixed), "fixed")
        given = f.raw("server_flags")
        flags = Fields(given if isinstance(given, dict) else {}, "fixed.server_flags")
        gpu, count = f.raw("gpu_name"), f.raw("gpu_count")
        hardware = "cpu" if gpu in (None, "cpu") else f"{gpu} x{count if isinstance(count, int) else '?'}"
        name = flags.raw("model_name") or pathlib.Path(str(f.raw("model_path") or "unknown")).name
        digest = f.raw("weights_sha256")
        model = f"{name} ({digest[:12]})" if isinstance(digest, str) else str(name)
        return cls.from_flags(hardware, model, str(f.raw("dtype") or "unknown"),
                              {flag: str(value) for flag, value in flags.data.items()})

    @classmethod
    def from_flags(cls, hardware: str, model: str, dtype: str, server_flags: Mapping[str, str]) -> CalibrationKey:
        """The key of a setup given by hand (a bare step log's): `server_flags` reduced to COST_FLAGS as a run
        directory's are (flags at their _KEY_DEFAULTS left out)."""
        configuration = tuple(sorted((flag, server_flags[flag]) for flag in COST_FLAGS
                                     if flag in server_flags and server_flags[flag] != _KEY_DEFAULTS.get(flag)))
        return cls(hardware, model, dtype, configuration)


@dataclass(frozen=True)
class Calibration:
    """One fitted step-time model and where it came from."""

    key: CalibrationKey
    coefficients: StepTimeCoefficients
    fit: FitError
    """The fit's error on its own steps."""
    runs: tuple[str, ...]
    """The run directories fitted on."""
    held_out: FitError | None = None
    """The coefficients' error on the steps of runs not fitted on (None: none given)."""
    held_out_runs: tuple[str, ...] = ()
    fit_window: int = 1
    """Consecutive steps per fitted sum (`bench calibrate --fit-window`; 1: each step, as files without it)."""
    spread: tuple[float, ...] = ()
    """step_model.step_spread of the fitted steps (`step_spread` in the file; () in files from before it)."""
    front_end: FrontEnd | None = None
    """The front end's share of TTFT (bench/measure/front_end.py; None: not fitted, as files from before it)."""

    def to_json(self) -> dict[str, JSON]:
        value: dict[str, JSON] = {"key": self.key.to_json(), "coefficients": dict(self.coefficients.to_json()),
                                  "fit": dict(self.fit.to_json()), "runs": list(self.runs)}
        if self.held_out is not None:
            value.update(held_out=dict(self.held_out.to_json()), held_out_runs=list(self.held_out_runs))
        if self.fit_window != 1:
            value["fit_window"] = self.fit_window
        if self.spread:
            value["step_spread"] = list(self.spread)
        if self.front_end is not None:
            value["front_end"] = self.front_end.to_json()
        return value

    @classmethod
    def from_json(cls, value: JSON, where: str) -> Calibration:
        if not isinstance(value, dict):
            raise CalibrationError(f"{where}: a calibration must be an object")
        parts = [value.get(name) for name in ("key", "coefficients", "fit")]
        runs = value.get("runs", [])
        if not all(isinstance(p, dict) for p in parts) or not isinstance(runs, list):
            raise CalibrationError(f"{where}: key, coefficients and fit must be objects, runs a list")
        key, coefficients, fit = (p if isinstance(p, dict) else {} for p in parts)
        held_out, held_out_runs = value.get("held_out"), value.get("held_out_runs", [])
        window = value.get("fit_window", 1)
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise CalibrationError(f"{where}: fit_window must be an integer >= 1")
        spread = _spread(value.get("step_spread", []), where)
        front_end = value.get("front_end")
        try:
            return cls(CalibrationKey.from_json(key, where + ".key"),
                       StepTimeCoefficients.from_json(coefficients, where + ".coefficients"),
                       FitError.from_json(fit, where + ".fit"), tuple(str(r) for r in runs),
                       FitError.from_json(held_out, where + ".held_out") if isinstance(held_out, dict) else None,
                       tuple(str(r) for r in held_out_runs) if isinstance(held_out_runs, list) else (), window,
                       spread, None if front_end is None else FrontEnd.from_json(front_end, where))
        except ValueError as error:
            raise CalibrationError(str(error)) from None


ASYNC_FIT_WINDOW = 8
"""The default window for a log of an engine with async scheduling. Its records can carry part of a
neighbour's time: logs written before the engine's fixed step timing moved it outright, and the device
still runs step N while N+1 is launched. A sum of consecutive steps cancels that. Measured
(docs/decision.md, "Fitting windows of steps"): K = 8 met the same-GPU goals on every held-out H100 and
H200 run; K = 1 missed the H200's TTFT p95 by 16-34%. A synchronous log keeps single steps."""


def default_fit_window(key: CalibrationKey) -> int:
    """ASYNC_FIT_WINDOW for runs served with async scheduling, else 1 (`bench calibrate` without --fit-window)."""
    return ASYNC_FIT_WINDOW if dict(key.configuration).get("async_scheduling", "").lower() == "true" else 1


def calibrate(run_dirs: Sequence[pathlib.Path], held_out: Sequence[pathlib.Path] = (),
              window: int | None = None) -> Calibration:
    """Fit one step-time model to the step logs of `run_dirs`, which must share one key, and measure the
    engine's time between steps on the same logs (step_model.py says why); its error is also measured on
    the steps of `held_out` (same key, not fitted on): the honest number. `window` > 1 fits sums of that
    many consecutive steps of each log (`fit_step_model`); None: `default_fit_window` of the runs' key."""
    key, _, _ = _steps([*run_dirs, *held_out])  # one key for all: a held-out run of another setup proves nothing
    held_logs = _steps(held_out)[2] if held_out else []
    return _fit(key, _steps(run_dirs)[2], held_logs, tuple(str(d) for d in run_dirs),
                tuple(str(d) for d in held_out), window)


STEP_LOG_FIELDS = ("num_prefill_reqs", "num_decode_reqs", "num_prefill_tokens", "num_decode_tokens",
                   "num_context_tokens", "step_time_s")
"""What every record of a bare step log must give (core/step_log.py's StepRecord names): the fit's terms and
the time. `start_s` and `end_s`, where given, measure the time between steps (step_model.between_steps_s)."""


def calibrate_step_logs(key: CalibrationKey, logs: Sequence[pathlib.Path], held_out: Sequence[pathlib.Path] = (),
                        window: int | None = None) -> Calibration:
    """`calibrate` for step-log files with no run directory (JSONL of core/step_log.py's records, as GET
    /step_log hands them over, each with STEP_LOG_FIELDS), under the `key` the caller says they share: fitted
    on `logs`, the error also measured on `held_out`'s steps."""
    fitted, held = [_file_rows(path) for path in logs], [_file_rows(path) for path in held_out]
    return _fit(key, fitted, held, tuple(str(p) for p in logs), tuple(str(p) for p in held_out), window)


def _fit(key: CalibrationKey, logs: Sequence[Sequence[Mapping[str, JSON]]],
         held_logs: Sequence[Sequence[Mapping[str, JSON]]], runs: tuple[str, ...], held_out_runs: tuple[str, ...],
         window: int | None) -> Calibration:
    """The fit of `logs` (each one run's rows in logged order), its error on `held_logs` when any are given."""
    window = default_fit_window(key) if window is None else window
    per_log = [_samples(rows) for rows in logs]
    fitted = [sample for samples in per_log for sample in samples]
    try:
        coefficients, fit = fit_step_model(fitted, window, [len(s) for s in per_log], cpu=key.hardware == "cpu")
        error = fit_error(coefficients, [s for rows in held_logs for s in _samples(rows)]) if held_logs else None
    except ValueError as problem:
        raise CalibrationError(str(problem)) from None
    coefficients = replace(coefficients, between_steps_s=between_steps_s(logs))
    return Calibration(key, coefficients, fit, runs, error, held_out_runs, window, step_spread(coefficients, fitted))


def _samples(rows: Sequence[Mapping[str, JSON]]) -> list[StepSample]:
    return [sample for sample in map(StepSample.from_record, rows) if sample is not None]


def _file_rows(path: pathlib.Path) -> list[dict[str, JSON]]:
    """A bare step log's records, each checked for STEP_LOG_FIELDS (CalibrationError names the file and line)."""
    try:
        rows = read_step_log_file(path)
    except (OSError, ValueError) as error:
        raise CalibrationError(f"{path}: not a step log (JSONL of step records): {error}") from None
    if not rows:
        raise CalibrationError(f"{path}: no step records")
    for line, row in enumerate(rows, 1):
        missing = [name for name in STEP_LOG_FIELDS if name not in row]
        if missing:
            raise CalibrationError(f"{path}: record {line} lacks {', '.join(missing)} (each record needs "
                                   f"{', '.join(STEP_LOG_FIELDS)})")
    return rows


def _spread(value: JSON, where: str) -> tuple[float, ...]:
    """A file's step_spread: positive numbers, ascending."""
    if not isinstance(value, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                                              for v in value):
        raise CalibrationError(f"{where}: step_spread must be a list of numbers > 0")
    spread = tuple(float(v) for v in value)  # type: ignore[arg-type]
    if list(spread) != sorted(spread):
        raise CalibrationError(f"{where}: step_spread must be ascending (quantiles)")
    return spread


def run_paces(coefficients: StepTimeCoefficients, run_dirs: Sequence[pathlib.Path]) -> list[tuple[str, float]]:
    """Each run's pace under `coefficients` (step_model.pace: summed predicted / measured step time), in order;
    a path that is a file is a bare step log (`calibrate_step_logs`)."""
    try:
        return [(str(run), pace(coefficients, _samples(_file_rows(run)) if run.is_file() else _steps([run])[1]))
                for run in run_dirs]
    except ValueError as problem:
        raise CalibrationError(str(problem)) from None


def _steps(run_dirs: Sequence[pathlib.Path]) -> tuple[CalibrationKey, list[StepSample], list[list[dict[str, JSON]]]]:
    """The key the runs share, their logged steps, and each run's log rows in logged order (CalibrationError
    when they differ or lack a log)."""
    if not run_dirs:
        raise CalibrationError("no run directories to calibrate from")
    keys: dict[CalibrationKey, list[str]] = {}
    samples: list[StepSample] = []
    logs = []
    for run_dir in run_dirs:
        rows = read_step_log(run_dir)
        if not rows:
            raise CalibrationError(f"{run_dir}: no {STEP_LOG_FILE} (run `conveyor bench run --collect-step-log` "
                                   "against a server started with --step-log-size N)")
        keys.setdefault(CalibrationKey.from_fixed(_fixed(run_dir)), []).append(str(run_dir))
        samples.extend(_samples(rows))
        logs.append(rows)
    if len(keys) > 1:
        detail = "; ".join(f"{', '.join(runs)}: {key.to_json()}" for key, runs in keys.items())
        raise CalibrationError(f"the runs differ in hardware, model, dtype or configuration: {detail}")
    return next(iter(keys)), samples, logs


def _fixed(run_dir: pathlib.Path) -> Mapping[str, JSON]:
    """The run's fixed things, read through the typed summary like every other reader of a run directory."""
    try:
        return load_run(run_dir).summary.fixed
    except RunDirError as error:
        raise CalibrationError(f"cannot read the run's summary: {error}") from None


def read_calibrations(path: pathlib.Path) -> list[Calibration]:
    """Every calibration in a file (none when the file does not exist)."""
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise CalibrationError(f"{path}: not a calibration file: {error}") from None
    entries = data.get("calibrations") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise CalibrationError(f"{path}: not a calibration file (no `calibrations` list)")
    return [Calibration.from_json(entry, f"{path}: calibrations[{i}]") for i, entry in enumerate(entries)]


def write_calibration(path: pathlib.Path, calibration: Calibration) -> None:
    """Add `calibration` to the file, replacing any entry with the same key."""
    kept = [c for c in read_calibrations(path) if c.key != calibration.key]
    data = {"schema_version": CALIBRATION_SCHEMA_VERSION, "calibrations": [c.to_json() for c in kept + [calibration]]}
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
