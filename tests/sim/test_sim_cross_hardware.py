"""`conveyor simulate --target-gpu`: a calibration scaled term by term to another GPU, the pool from the plan."""

from __future__ import annotations

import pathlib

import pytest

from conveyor import cli
from conveyor.bench.measure.calibration import (
    Calibration,
    CalibrationKey,
    write_calibration,
)
from conveyor.bench.measure.rundirs import load_run
from conveyor.bench.measure.step_model import FitError, StepTimeCoefficients
from conveyor.bench.measure.summary import Simulated
from conveyor.bench.plan.gpu_catalog import find_gpu
from conveyor.bench.report.dashboard import ReportInputs, analyze, decision_lines
from conveyor.config import CacheConfig, SchedulerConfig
from conveyor.core.step_time import CalibratedStepTime
from conveyor.sim.cross_hardware import (
    HardwareScale,
    ModelWork,
    catalog_gpu,
    model_work,
    plan_num_blocks,
    scale_step_time,
    scaled_for_validation,
)
from conveyor.sim.engine_setup import EngineSetup

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "bench" / "fixtures" / "models"
FIT = FitError(num_steps=100, r2=0.99, median_rel_error=0.02, p95_rel_error=0.08)
H100_KEY = CalibrationKey("NVIDIA H100 80GB HBM3 x1", "llama-3.1-8b (abc)", "bfloat16", (("device", "cuda"),))
CALIBRATION = Calibration(H100_KEY, StepTimeCoefficients(0.010, 2e-5, 3e-5, 4e-5, 5e-9), FIT, ("runs/a",))


def test_h100_to_h200_scales_memory_terms_by_bandwidth_only() -> None:
    scale = HardwareScale(find_gpu("H100"), find_gpu("H200"))
    assert scale.bandwidth_ratio == pytest.approx(3.35 / 4.8) and scale.compute_ratio == 1.0
    scaled = scale_step_time(CalibratedStepTime(0.010, 2e-5, 3e-5, 4e-5, 5e-9, between_steps_s=6e-4, label="h100",
                                                front_end_in_s=(0.0, 0.01), front_end_out_s=0.02), scale)
    assert scaled.per_step_s == pytest.approx(0.010 * 3.35 / 4.8)
    assert scaled.between_steps_s == 6e-4  # the host loop's, not the GPU's
    assert (scaled.front_end_in_s, scaled.front_end_out_s) == ((0.0, 0.01), 0.02)  # the API server's, too
    assert scaled.per_context_token_s == pytest.approx(5e-9 * 3.35 / 4.8)
    assert (scaled.per_seq_s, scaled.per_prefill_token_s, scaled.per_decode_token_s) == (2e-5, 3e-5, 4e-5)


def test_a100_to_h100_scales_compute_terms_by_flops() -> None:
    scale = HardwareScale(find_gpu("A100"), find_gpu("H100"))
    scaled = scale_step_time(CalibratedStepTime(0.010, 2e-5, 3e-5, 4e-5, 5e-9), scale)
    assert scaled.per_prefill_token_s == pytest.approx(3e-5 * 312 / 989)
    assert scaled.per_decode_token_s == pytest.approx(4e-5 * 312 / 989)
    assert scaled.per_step_s == pytest.approx(0.010 * 2.039 / 3.35) and scaled.per_seq_s == 2e-5


def test_only_a_terms_work_at_the_source_peak_is_scaled() -> None:
    """Issue 36: the Qwen3-32B shape's decode step took 23.7 ms on the H100 and 18.1 ms on the H200, 1.31x,
    not the bandwidths' 1.43x: 19.1 ms of it is the weights' 64 GB at the H100's peak, the rest is not the
    bandwidth's. With the model's work the floor is scaled and the excess kept; a term under its floor
    (here the context token's, 30 ns against 78 ns for 256 KiB) is scaled whole."""
    work = ModelWork(step_bytes=64e9, context_token_bytes=262_144, token_flops=16e9)
    model = CalibratedStepTime(0.0235, 2e-5, 9e-5, 9e-5, 30e-9, per_multi_row_step_s=4e-4, between_steps_s=6e-4)
    scaled = scale_step_time(model, HardwareScale(find_gpu("H100"), find_gpu("H200")), work)
    floor = 64e9 / 3.35e12
    assert scaled.per_step_s == pytest.approx(floor * 3.35 / 4.8 + (0.0235 - floor))
    assert scaled.per_context_token_s == pytest.approx(30e-9 * 3.35 / 4.8)
    assert (scaled.per_prefill_token_s, scaled.between_steps_s) == (9e-5, 6e-4)
    assert "roofline" in scaled.label
    a100 = scale_step_time(model, HardwareScale(find_gpu("A100"), find_gpu("H100")), work)
    compute_floor = 16e9 / 312e12
    assert a100.per_prefill_token_s == pytest.approx(compute_floor * 312 / 989 + (9e-5 - compute_floor))
    assert scale_step_time(model, HardwareScale(find_gpu("H100"), find_gpu("H200"))).per_step_s == pytest.approx(
        0.0235 * 3.35 / 4.8)  # without the model, the whole term


def test_the_model_work_comes_from_its_config() -> None:
    work = model_work(FIXTURES / "llama-3.1-8b", CALIBRATION)
    embedding = 128_256 * 4096  # Llama-3.1-8B: untied, so only the LM head's copy is read whole
    assert work.step_bytes == pytest.approx((8_030_261_248 - embedding) * 2)
    assert work.context_token_bytes == 131_072
    assert work.token_flops == pytest.approx(2 * (8_030_261_248 - 2 * embedding - 266_240), rel=1e-6)
    scaled, simulated = scaled_for_validation(CalibratedStepTime(0.010, 0.0, 3e-5, 4e-5, 5e-9), [CALIBRATION],
                                              "H200", Simulated(step_time="x"), FIXTURES / "llama-3.1-8b")
    assert scaled.per_step_s == pytest.approx(0.010 - work.step_bytes / 3.35e12 * (1 - 3.35 / 4.8))
    assert simulated.target_gpu == "H200 (from H100)" and "roofline" in simulated.step_time


def test_the_calibrations_hardware_names_a_catalog_gpu() -> None:
    assert catalog_gpu("NVIDIA H100 80GB HBM3 x1").name == "H100"
    assert catalog_gpu("NVIDIA H200 x8").name == "H200"
    assert catalog_gpu("NVIDIA A100-SXM4-80GB x1").name == "A100-80GB"
    with pytest.raises(ValueError, match="not a GPU of the catalog"):
        catalog_gpu("cpu")
    with pytest.raises(ValueError, match="no memory bandwidth for B300"):
        _ = HardwareScale(find_gpu("H100"), find_gpu("B300")).bandwidth_ratio


def test_the_target_pool_comes_from_the_memory_plan() -> None:
    setup = EngineSetup(SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=8192, max_model_len=8192),
                        CacheConfig(block_size=16), 1)
    config = FIXTURES / "llama-3.1-8b"
    h100, h200 = (plan_num_blocks(config, setup, find_gpu(g), CALIBRATION, 0.9) for g in ("H100", "H200"))
    assert h200 > h100 > 0
    per_block = 131_072 * 16  # Llama-3.1-8B: 128 KiB of KV per token in bf16
    assert (h200 - h100) * per_block == pytest.approx((150_109_880_320 - 81559 * 2**20) * 0.9, rel=1e-3)


def test_target_gpu_writes_a_run_marked_cross_hardware(tmp_path: pathlib.Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    calib = tmp_path / "calib.json"
    write_calibration(calib, CALIBRATION)
    trace = tmp_path / "t.jsonl"
    assert cli.main(["trace", "make", "--num-requests", "20", "--seed", "1", "--out", str(trace),
                     "--max-model-len", "2048"]) == 0
    base = ["simulate", "--trace", str(trace), "--rate", "4", "--calibration", str(calib), "--target-gpu", "H200"]
    assert cli.main([*base, "--out-dir", str(tmp_path / "x")]) == 2
    assert "--model-config" in capsys.readouterr().err
    out = tmp_path / "h200"
    assert cli.main([*base, "--out-dir", str(out), "--model-config", str(FIXTURES / "llama-3.1-8b")]) == 0
    simulated = load_run(out).summary.simulated
    assert simulated is not None and simulated.target_gpu == "H200 (from H100)"
    assert "scaled H100 -> H200" in simulated.step_time
    assert any("cross-hardware" in line for line in decision_lines(analyze(ReportInputs((out,)))))


def test_an_fp8_kv_calibration_plans_twice_the_target_blocks() -> None:
    """Issue 37: the calibrated server's --kv-cache-dtype is part of its key, and the target's pool is
    planned at that dtype (one byte per element: twice bf16's blocks from the same budget)."""
    from conveyor.bench.measure.calibration import CalibrationKey

    fixed = {"gpu_name": "NVIDIA H100 80GB HBM3", "gpu_count": 1, "dtype": "bfloat16",
             "server_flags": {"device": "cuda", "kv_cache_dtype": "fp8"}}
    key = CalibrationKey.from_fixed(fixed)
    assert dict(key.configuration) == {"device": "cuda", "kv_cache_dtype": "fp8"}
    auto = {**fixed, "server_flags": {"device": "cuda", "kv_cache_dtype": "auto"}}
    assert CalibrationKey.from_fixed(auto).configuration == H100_KEY.configuration  # as runs before the flag
    setup = EngineSetup(SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=8192, max_model_len=8192),
                        CacheConfig(block_size=16), 1)
    fp8 = Calibration(key, CALIBRATION.coefficients, FIT, ("runs/b",))
    config = FIXTURES / "llama-3.1-8b"
    bf16_blocks = plan_num_blocks(config, setup, find_gpu("H200"), CALIBRATION, 0.9)
    assert plan_num_blocks(config, setup, find_gpu("H200"), fp8, 0.9) == pytest.approx(2 * bf16_blocks, rel=0.01)
