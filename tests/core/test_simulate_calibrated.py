"""`conveyor simulate --calibration`: the simulation prices steps by a calibration bench wrote."""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib

import pytest

from conveyor.bench.measure import step_model
from conveyor.bench.measure.calibration import (
    Calibration,
    CalibrationKey,
    calibrate,
    write_calibration,
)
from conveyor.bench.measure.front_end import FrontEnd
from conveyor.bench.measure.step_model import FitError, StepSample, StepTimeCoefficients
from conveyor.core import simulate_cli
from conveyor.core.simulate import (
    SimulationConfig,
    StepTimeModel,
    WorkloadConfig,
    simulate,
)
from conveyor.core.step_log import StepRecord
from conveyor.core.step_time import GEMM_STEP_ROWS, CalibratedStepTime, read_calibration
from conveyor.model.quantized import MAX_KERNEL_ROWS

SMALL = SimulationConfig(workload=WorkloadConfig(num_requests=40, request_rate=6.0, long_fraction=0.15,
                                                 long_prompt_tokens=512, long_output_tokens=128))
FIT = FitError(num_steps=100, r2=0.99, median_rel_error=0.02, p95_rel_error=0.08)


def entry(hardware: str, coefficients: StepTimeCoefficients) -> Calibration:
    return Calibration(CalibrationKey(hardware, "llama (abc)", "bfloat16", (("device", "cuda"),)), coefficients, FIT,
                       ("runs/a",))


def test_what_bench_writes_the_simulation_reads(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "calib.json"
    h100 = StepTimeCoefficients(0.01, 2e-5, 3e-5, 4e-5, 5e-9, 6e-3, 7e-4, per_gemm_step_s=0.04)
    write_calibration(path, entry("NVIDIA H100 80GB HBM3 x1", h100))
    write_calibration(path, entry("NVIDIA H200 x1", StepTimeCoefficients(0.008, 1e-5, 2e-5, 3e-5, 4e-9)))
    model = read_calibration(str(path), hardware="h100")
    assert (model.per_step_s, model.per_seq_s, model.per_prefill_token_s, model.per_decode_token_s,
            model.per_context_token_s, model.per_multi_row_step_s, model.per_gemm_step_s) == h100.values
    assert model.between_steps_s == h100.between_steps_s
    assert "H100" in model.label
    with pytest.raises(ValueError, match="2 calibrations match"):
        read_calibration(str(path))


def test_a_file_from_before_the_multi_row_term_reads_it_as_zero(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "calib.json"
    write_calibration(path, entry("cpu", StepTimeCoefficients(0.01, 2e-5, 3e-5, 4e-5, 5e-9, 6e-3, 5e-4)))
    text = path.read_text().replace('"per_multi_row_step_s"', '"unknown_term"').replace('"between_steps_s"', '"x"')
    path.write_text(text)
    assert read_calibration(str(path)).per_multi_row_step_s == 0.0
    assert read_calibration(str(path)).between_steps_s == 0.0
    assert read_calibration(str(path)).per_gemm_step_s == 0.0  # written before the term: no key at all


def test_a_simulated_step_lasts_the_busy_engines_period_not_only_its_step_time(tmp_path: pathlib.Path) -> None:
    # The engine logs each step's own time; the loop then takes 0.6 ms before the next step starts. Priced by
    # step time alone a replay runs 0.6 ms a step fast (issue 36: H100 requests ended ~0.3 s early).
    model = StepTimeCoefficients(0.02, 0.0, 1e-4, 1e-4, 0.0)
    rows, start_s = [], 50.0
    for decodes in [1, 2, 3, 4, 5, 6, 7, 8] * 4:
        time_s = model.predict_s(StepSample(decodes, 0, decodes, 0, 1.0))
        rows.append({"num_decode_tokens": decodes, "num_decode_reqs": decodes, "step_time_s": time_s,
                     "start_s": start_s})
        start_s += time_s + 6e-4
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"fixed": {"gpu_name": "cpu", "server_flags": {}}}))
    (run / "step_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_calibration(tmp_path / "calib.json", calibrate([run]))
    priced = read_calibration(str(tmp_path / "calib.json"))
    four = StepRecord(num_prefill_tokens=0, num_decode_tokens=4, num_prefill_reqs=0, num_decode_reqs=4,
                      num_context_tokens=0)
    assert priced.batch_time_s(four) == pytest.approx(0.02 + 4e-4 + 6e-4)


def test_the_multi_row_term_prices_only_steps_of_more_than_one_token() -> None:
    model = CalibratedStepTime(0.004, 0.003, 1e-3, 0.0, 0.0, per_multi_row_step_s=0.005)
    one_decode = StepRecord(num_prefill_tokens=0, num_decode_tokens=1, num_prefill_reqs=0, num_decode_reqs=1,
                            num_context_tokens=100)
    two_decodes = StepRecord(num_prefill_tokens=0, num_decode_tokens=2, num_prefill_reqs=0, num_decode_reqs=2,
                             num_context_tokens=200)
    one_token_prefill = StepRecord(num_prefill_tokens=1, num_decode_tokens=0, num_prefill_reqs=1,
                                   num_decode_reqs=0, num_context_tokens=1)
    prefill = StepRecord(num_prefill_tokens=40, num_decode_tokens=0, num_prefill_reqs=1, num_decode_reqs=0,
                         num_context_tokens=40)
    assert model.batch_time_s(one_decode) == pytest.approx(0.007)
    assert model.batch_time_s(two_decodes) == pytest.approx(0.004 + 0.006 + 0.005)
    assert model.batch_time_s(one_token_prefill) == pytest.approx(0.004 + 0.003 + 1e-3)
    assert model.batch_time_s(prefill) == pytest.approx(0.004 + 0.003 + 0.04 + 0.005)


def test_the_gemm_term_prices_only_steps_past_the_cpu_kernels_rows() -> None:
    # the CPU's block kernel takes up to MAX_KERNEL_ROWS rows; past it the weights are dequantized for a GEMM
    assert GEMM_STEP_ROWS == MAX_KERNEL_ROWS == step_model.GEMM_STEP_ROWS  # the fit's and the price's threshold
    model = CalibratedStepTime(0.01, 0.0, 2e-3, 3e-3, 0.0, per_multi_row_step_s=0.007, per_gemm_step_s=0.045)
    def prompt(tokens: int) -> StepRecord:
        return StepRecord(num_prefill_tokens=tokens, num_decode_tokens=0, num_prefill_reqs=1, num_decode_reqs=0,
                          num_context_tokens=tokens)
    assert model.batch_time_s(prompt(GEMM_STEP_ROWS)) == pytest.approx(0.017 + GEMM_STEP_ROWS * 2e-3)
    assert model.batch_time_s(prompt(GEMM_STEP_ROWS + 1)) == pytest.approx(0.062 + (GEMM_STEP_ROWS + 1) * 2e-3)
    assert "45 ms/GEMM step" in model.describe()


def test_a_calibration_with_only_token_costs_is_the_two_parameter_model() -> None:
    linear = StepTimeModel(step_time_base_s=0.02, step_time_per_token_s=1e-4)
    calibrated = CalibratedStepTime(0.02, 0.0, 1e-4, 1e-4, 0.0)
    assert simulate(dataclasses.replace(SMALL, step_time=calibrated)) == simulate(dataclasses.replace(SMALL, step_time=linear))


def test_context_cost_slows_long_requests_down() -> None:
    base = CalibratedStepTime(0.02, 0.0, 1e-4, 1e-4, 0.0)
    attended = dataclasses.replace(base, per_context_token_s=1e-6)
    fast, slow = (simulate(dataclasses.replace(SMALL, step_time=m)) for m in (base, attended))
    assert slow.e2e_p95_s > fast.e2e_p95_s
    assert slow.mean_tokens_per_step > fast.mean_tokens_per_step  # slower steps: more arrivals join each batch


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    simulate_cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_cli_uses_the_calibration_and_refuses_it_with_the_linear_flags(
        tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "calib.json"
    write_calibration(path, entry("cpu", StepTimeCoefficients(0.01, 0.0, 5e-5, 5e-5, 0.0)))
    assert simulate_cli.run(_args("--num-requests", "10", "--calibration", str(path))) == 0
    assert "calibrated (cpu | llama (abc) | bfloat16)" in capsys.readouterr().out
    assert simulate_cli.run(_args("--calibration", str(path), "--step-time-base-s", "0.01")) == 2
    assert "--calibration" in capsys.readouterr().err
    assert simulate_cli.run(_args("--calibration", str(tmp_path / "missing.json"))) == 2


def test_the_spread_bench_measures_reaches_the_simulation_only_when_asked(tmp_path: pathlib.Path) -> None:
    # Steps alternate 0.9x and 1.3x a 20 ms price: the fit lands between, the spread keeps both sides.
    rows, start_s = [], 10.0
    for i in range(40):
        time_s = 0.02 * (0.9 if i % 2 else 1.3) * (1 + i % 3 * 1e-3)
        rows.append({"num_decode_tokens": 1, "num_decode_reqs": 1, "step_time_s": time_s, "start_s": start_s})
        start_s += time_s + 1e-4
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"fixed": {"gpu_name": "cpu", "server_flags": {}}}))
    (run / "step_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = tmp_path / "calib.json"
    write_calibration(path, calibrate([run]))
    spread = read_calibration(str(path)).spread
    assert len(spread) == 21 and list(spread) == sorted(spread)
    assert spread[0] == pytest.approx(0.9 / 1.1, rel=0.01) and spread[-1] == pytest.approx(1.3 / 1.1, rel=0.01)
    assert simulate_cli.build_config(_args("--calibration", str(path))).step_time.spread == ()  # type: ignore[union-attr]
    chosen = simulate_cli.build_config(_args("--calibration", str(path), "--step-spread")).step_time
    assert chosen.spread == spread  # type: ignore[union-attr]


def test_a_spread_must_be_ascending_positive_quantiles(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="step_spread"):
        CalibratedStepTime(0.01, 0.0, 0.0, 0.0, 0.0, spread=(1.2, 0.8))
    path = tmp_path / "calib.json"
    write_calibration(path, entry("cpu", StepTimeCoefficients(0.01, 0.0, 5e-5, 5e-5, 0.0)))
    text = path.read_text().replace('"runs":', '"step_spread": [1.1, 0.9], "runs":')
    path.write_text(text)
    with pytest.raises(ValueError, match="step_spread"):
        read_calibration(str(path))


def test_a_fitted_front_end_is_read_and_a_file_without_one_has_none(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "calib.json"
    coefficients = StepTimeCoefficients(0.01, 2e-5, 3e-5, 4e-5, 5e-9)
    write_calibration(path, dataclasses.replace(entry("cpu", coefficients),
                                                front_end=FrontEnd((0.0, 0.002, 0.05), 0.018, 480)))
    model = read_calibration(str(path))
    assert model.front_end_in_s == (0.0, 0.002, 0.05) and model.front_end_out_s == 0.018
    assert model.in_delay_s(0.25) == pytest.approx(0.001) and model.in_delay_s(1.0) == 0.05
    assert "front end" in model.describe()
    write_calibration(path, entry("cpu", coefficients))  # replaces it: an entry as written before the front end
    assert "front_end" not in path.read_text()
    old = read_calibration(str(path))
    assert old.front_end_in_s == () and old.front_end_out_s == 0.0 and old.in_delay_s(0.9) == 0.0
    with pytest.raises(ValueError, match="ascending"):
        CalibratedStepTime(0.01, 0.0, 0.0, 0.0, 0.0, front_end_in_s=(0.02, 0.01))
