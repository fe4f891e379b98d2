"""Bare step logs (a server another client drove: no run directory) are fitted as a run directory's are."""

from __future__ import annotations

import gzip
import json
import pathlib

import pytest
from test_step_model import FIXED, TRUE, back_to_back, synthetic_steps, write_run

from conveyor.bench.measure.calibration import (
    ASYNC_FIT_WINDOW,
    CalibrationError,
    CalibrationKey,
    calibrate,
    calibrate_step_logs,
    read_calibrations,
    run_paces,
)
from conveyor.bench.measure.step_model import StepTimeCoefficients
from conveyor.cli import main

HARDWARE = "NVIDIA H100 80GB HBM3 x1"
FLAGS = {"device": "cuda", "block_size": "16", "tensor_parallel_size": "1"}


def write_log(path: pathlib.Path, rows: list[dict]) -> pathlib.Path:
    text = "".join(json.dumps(row) + "\n" for row in rows)
    if path.suffix == ".gz":
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def test_a_bare_log_fits_as_its_run_directory_does(tmp_path: pathlib.Path) -> None:
    rows = back_to_back(synthetic_steps(120, TRUE, noise=0.02, seed=5), 5e-4)
    run = write_run(tmp_path / "run", rows)
    key = CalibrationKey.from_flags(HARDWARE, "llama (abababababab)", "bfloat16", {**FLAGS, "max_num_seqs": "256"})
    assert key == CalibrationKey.from_fixed(FIXED)  # scheduler limits are not part of the key, as from a run
    for log in (write_log(tmp_path / "a.jsonl", rows), write_log(tmp_path / "a.jsonl.gz", rows)):
        bare = calibrate_step_logs(key, [log])
        assert bare.coefficients == calibrate([run]).coefficients and bare.runs == (str(log),)
        assert bare.coefficients.between_steps_s == pytest.approx(5e-4)


def test_held_out_logs_are_measured_not_fitted(tmp_path: pathlib.Path) -> None:
    fitted = write_log(tmp_path / "fit.jsonl", synthetic_steps(200, TRUE, seed=3))
    slower = StepTimeCoefficients(*(1.2 * v for v in TRUE.values))
    held = write_log(tmp_path / "held.jsonl", synthetic_steps(100, slower, seed=4))
    calibration = calibrate_step_logs(CalibrationKey.from_flags("cpu", "m", "float32", {}), [fitted], [held])
    assert calibration.fit.num_steps == 200 and calibration.fit.r2 == pytest.approx(1.0)
    assert calibration.held_out is not None and calibration.held_out.num_steps == 100
    assert calibration.held_out.median_rel_error == pytest.approx(1 - 1 / 1.2, abs=0.01)
    paces = run_paces(calibration.coefficients, [fitted, held])
    assert [round(p, 3) for _, p in paces] == [1.0, pytest.approx(1 / 1.2, abs=1e-3)]


def test_an_async_key_fits_windows_and_a_record_lacking_a_field_is_refused(tmp_path: pathlib.Path) -> None:
    rows = synthetic_steps(100, TRUE)
    key = CalibrationKey.from_flags(HARDWARE, "m", "bfloat16", {"async_scheduling": "true"})
    assert calibrate_step_logs(key, [write_log(tmp_path / "a.jsonl", rows)]).fit_window == ASYNC_FIT_WINDOW
    del rows[7]["num_context_tokens"]
    with pytest.raises(CalibrationError, match=r"b.jsonl: record 8 lacks num_context_tokens"):
        calibrate_step_logs(key, [write_log(tmp_path / "b.jsonl", rows)])
    with pytest.raises(CalibrationError, match="no step records"):
        calibrate_step_logs(key, [write_log(tmp_path / "empty.jsonl", [])])


def test_bench_calibrate_step_log_cli(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    fitted = write_log(tmp_path / "r16.jsonl", synthetic_steps(200, TRUE, seed=1))
    held = write_log(tmp_path / "rinf.jsonl", synthetic_steps(80, TRUE, seed=2))
    out = tmp_path / "calib.json"
    key = ["--hardware", HARDWARE, "--model", "llama-3.1-8b", "--dtype", "bfloat16", "--server-flag", "device=cuda"]
    assert main(["bench", "calibrate", "--step-log", str(fitted), "--held-out-step-log", str(held), *key,
                 "--fit-window", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "per_step = 12 ms" in printed and "held out, 80 steps of 1 run(s): R² 1.000" in printed
    assert "fitted r16.jsonl 1.000; held out rinf.jsonl 1.000" in printed
    (calibration,) = read_calibrations(out)
    assert calibration.key == CalibrationKey(HARDWARE, "llama-3.1-8b", "bfloat16", (("device", "cuda"),))


@pytest.mark.parametrize(("argv", "flag"), [
    (["--step-log", "L", "--model", "m"], "--step-log needs --hardware"),
    (["--step-log", "L", "--hardware", "h"], "--step-log needs --model"),
    (["RUN", "--step-log", "L", "--hardware", "h", "--model", "m"], "not both"),
    (["RUN", "--hardware", "h"], "--hardware goes with --step-log"),
    (["--step-log", "L", "--hardware", "h", "--model", "m", "--server-flag", "max_num_seqs=8"], "--server-flag max_num"),
    ([], "give RUN_DIR... or --step-log"),
])
def test_bench_calibrate_step_log_errors_name_the_flag(argv: list[str], flag: str, tmp_path: pathlib.Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    log = str(write_log(tmp_path / "l.jsonl", synthetic_steps(60, TRUE)))
    argv = [log if a == "L" else str(tmp_path / "run") if a == "RUN" else a for a in argv]
    assert main(["bench", "calibrate", *argv, "--out", str(tmp_path / "c.json")]) == 2
    error = capsys.readouterr().err.strip()
    assert flag in error and "\n" not in error
