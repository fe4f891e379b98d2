"""`conveyor simulate --study`: bench's study run on the simulator, then a shortlist to verify on servers."""

from __future__ import annotations

import json
import pathlib

import pytest

from conveyor import cli
from conveyor.bench.decide.study import load_study_file, spec_from_mapping
from conveyor.bench.measure.calibration import (
    Calibration,
    CalibrationKey,
    write_calibration,
)
from conveyor.bench.measure.rundirs import discover_runs
from conveyor.bench.measure.step_model import FitError, StepTimeCoefficients
from conveyor.sim.study import check_simulable

FIT = FitError(num_steps=100, r2=0.99, median_rel_error=0.02, p95_rel_error=0.08)


def _files(tmp_path: pathlib.Path, variants: list[dict[str, object]]) -> tuple[pathlib.Path, pathlib.Path]:
    trace = tmp_path / "t.jsonl"
    assert cli.main(["trace", "make", "--mix", "chat=0.8,long=0.2", "--num-requests", "24", "--seed", "2",
                     "--out", str(trace), "--max-model-len", "2048"]) == 0
    study = {"command": "conveyor serve --port {port} {args}", "trace": str(trace),
             "slo": {"ttft_p95_ms": 1500, "e2e_p95_ms": 20000},
             "baseline": {"max_num_seqs": 2, "max_num_batched_tokens": 2048}, "variants": variants,
             "sweep": {"rates": [0.5, 2.0, 8.0], "num_repeats": 1, "max_repeats": 1}}
    study_file = tmp_path / "study.json"
    study_file.write_text(json.dumps(study))
    calibration = tmp_path / "calib.json"
    write_calibration(calibration, Calibration(CalibrationKey("cpu", "tiny (abc)", "float32", ()),
                                               StepTimeCoefficients(0.01, 0.0, 2e-5, 2e-5, 0.0), FIT, ("runs/a",)))
    return study_file, calibration


def test_a_study_on_the_simulator_shortlists_the_configurations_to_verify(
        tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    variants = [{"name": "seqs16", "max_num_seqs": 16}, {"name": "tiny_pool", "num_gpu_blocks_override": 40},
                {"name": "static", "batching": "static"}]
    study_file, calibration = _files(tmp_path, variants)
    out = tmp_path / "sim-study"
    assert cli.main(["simulate", "--study", str(study_file), "--calibration", str(calibration), "--out-dir", str(out),
                     "--shortlist", "1"]) == 0
    printed = capsys.readouterr().out
    assert "baseline" in printed and "seqs16" in printed and "verify on servers" in printed
    runs = discover_runs([out])
    assert runs and all(r.summary.simulated is not None for r in runs)
    assert {r.config_name for r in runs} == {"baseline", "seqs16", "tiny_pool", "static"}
    seqs16 = [r for r in runs if r.config_name == "seqs16"]
    assert {r.summary.fixed["server_flags"]["max_num_seqs"] for r in seqs16} == {"16"}  # type: ignore[index]
    shortlist = load_study_file(out / "shortlist.json")
    assert [v.name for v in shortlist.variants] == ["baseline", "seqs16"]  # more sequences: more capacity


def test_a_variant_the_simulation_cannot_price_is_refused(tmp_path: pathlib.Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    study_file, calibration = _files(tmp_path, [{"name": "fp8", "dtype": "fp8"}])
    with pytest.raises(ValueError, match="variant fp8 changes dtype"):
        check_simulable(spec_from_mapping(json.loads(study_file.read_text()), "study.json"))
    assert cli.main(["simulate", "--study", str(study_file), "--calibration", str(calibration),
                     "--out-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "dtype" in err


def test_a_duration_study_sends_what_bench_would_send_and_keeps_its_window(tmp_path: pathlib.Path) -> None:
    # bench run sends ceil(rate x duration_s) requests and summarizes only its window: so must the simulation,
    # or a past-capacity rate replays the whole trace and queues longer than the server was ever asked to.
    study_file, calibration = _files(tmp_path, [])
    study = json.loads(study_file.read_text())
    study["run"] = {"duration_s": 5, "warmup_requests": 1, "cooldown_requests": 2}
    study["sweep"]["rates"] = [2.0]
    study_file.write_text(json.dumps(study))
    out = tmp_path / "sim-study"
    assert cli.main(["simulate", "--study", str(study_file), "--calibration", str(calibration),
                     "--out-dir", str(out)]) == 0
    (run,) = discover_runs([out])
    assert run.summary.num_sent == 10  # ceil(2 req/s x 5 s) of the trace's 24
    assert run.summary.window["warmup_requests"] == 1 and run.summary.window["cooldown_requests"] == 2
    assert run.summary.completed == 7  # the 10 sent, less the window's 1 + 2


def test_a_duration_without_a_finite_rate_is_refused_in_one_line() -> None:
    from conveyor.bench.jsonvalue import Fields
    from conveyor.sim.study import requests_to_send
    with pytest.raises(ValueError, match="duration_s must be > 0 s with a finite rate"):
        requests_to_send(Fields.of({"duration_s": 10}, "[run]"), float("inf"), None)
    assert requests_to_send(Fields.of({"duration_s": 10, "num_requests": 7}, "[run]"), 2.0, None) == 7
    assert requests_to_send(Fields.of({"duration_s": 10}, "[run]"), 2.0, 40) == 40  # a lengthened repeat wins


def test_a_study_runs_on_a_gpu_it_was_not_measured_on(tmp_path: pathlib.Path) -> None:
    # --target-gpu: the H100 calibration's terms scaled to the H200, and each configuration's pool from the
    # memory plan at its own limits (a configuration that fixes its pool keeps it), as in --trace's what-if
    from conveyor.bench.plan.gpu_catalog import find_gpu
    from conveyor.sim.cross_hardware import plan_num_blocks
    from conveyor.sim.engine_setup import apply_flags, default_setup
    study_file, _ = _files(tmp_path, [{"name": "seqs64", "max_num_seqs": 64},
                                      {"name": "pool", "num_gpu_blocks_override": 500}])
    key = CalibrationKey("NVIDIA H100 80GB HBM3 x1", "llama-3.1-8b (abc)", "bfloat16", (("device", "cuda"),))
    calibration = Calibration(key, StepTimeCoefficients(0.01, 0.0, 2e-5, 2e-5, 1e-9), FIT, ("runs/a",))
    write_calibration(tmp_path / "h100.json", calibration)
    config = pathlib.Path(__file__).resolve().parents[1] / "bench" / "fixtures" / "models" / "llama-3.1-8b"
    out = tmp_path / "sim-h200"
    assert cli.main(["simulate", "--study", str(study_file), "--calibration", str(tmp_path / "h100.json"),
                     "--target-gpu", "H200", "--model-config", str(config), "--out-dir", str(out)]) == 0
    runs = discover_runs([out])
    assert runs and all(r.summary.simulated is not None and r.summary.simulated.target_gpu == "H200 (from H100)"
                        for r in runs)
    blocks = {r.config_name: r.summary.fixed["server_flags"]["num_kv_blocks"] for r in runs}  # type: ignore[index]
    for name, flags in (("baseline", {"max_num_seqs": "2", "max_num_batched_tokens": "2048"}),
                        ("seqs64", {"max_num_seqs": "64", "max_num_batched_tokens": "2048"})):
        setup = apply_flags(default_setup(), flags, name)
        # simulate plans at the engine's default utilization (vLLM 0.24's 0.92), as `serve` would run
        assert blocks[name] == str(plan_num_blocks(config, setup, find_gpu("H200"), calibration, 0.92))
    assert blocks["pool"] == "500"
    assert {r.summary.fixed.get("gpu_name") for r in runs} == {"H200"}  # reports group and price by it


def test_simulated_studies_on_two_gpus_are_priced_per_gpu(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    # the GPU question as a what-if: the H100's calibration on its own GPU and scaled to the H200, one report
    study_file, _ = _files(tmp_path, [])
    key = CalibrationKey("NVIDIA H100 80GB HBM3 x1", "llama-3.1-8b (abc)", "bfloat16", (("device", "cuda"),))
    write_calibration(tmp_path / "h100.json", Calibration(key, StepTimeCoefficients(0.01, 0.0, 2e-5, 2e-5, 1e-9),
                                                          FIT, ("runs/a",)))
    base = ["simulate", "--study", str(study_file), "--calibration", str(tmp_path / "h100.json"),
            "--num-gpu-blocks-override", "4096"]
    assert cli.main([*base, "--out-dir", str(tmp_path / "h100")]) == 0
    assert cli.main([*base, "--target-gpu", "H200", "--out-dir", str(tmp_path / "h200")]) == 0
    names = {r.summary.fixed.get("gpu_name") for r in discover_runs([tmp_path / "h100", tmp_path / "h200"])}
    assert names == {"NVIDIA H100 80GB HBM3", "H200"}
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert cli.main(["report", str(tmp_path / "h100"), str(tmp_path / "h200"), "--price", "H100=3",
                     "--price", "H200=4", "--out", str(tmp_path / "report")]) == 0
    printed = capsys.readouterr().out
    assert "GPU H100 (NVIDIA H100 80GB HBM3): $3/GPU-hour" in printed and "GPU H200 (H200): $4/GPU-hour" in printed
