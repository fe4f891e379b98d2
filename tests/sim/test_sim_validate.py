"""`conveyor simulate --validate`: signed relative errors per metric, and the refusal of fitted runs."""

from __future__ import annotations

import csv
import json
import pathlib

import pytest

from conveyor import cli
from conveyor.bench.measure.calibration import (
    Calibration,
    CalibrationKey,
    write_calibration,
)
from conveyor.bench.measure.server_summary import ServerSummary
from conveyor.bench.measure.step_model import FitError, StepTimeCoefficients
from conveyor.bench.measure.summary import RunIdentity, RunSummary, RunTotals
from conveyor.sim.validate import METRICS, RunValidation, compare, relative_error, repeat_means

FIT = FitError(num_steps=100, r2=0.99, median_rel_error=0.02, p95_rel_error=0.08)
KEY = CalibrationKey("cpu", "tiny (abc)", "float32", ())


def summary(throughput: float, ttft50: float, ttft95: float, itl50: float, e2e95: float, preempt: float,
            e2e50: float = 1000.0, itl_mean: float = 22.0) -> RunSummary:
    return RunSummary(RunIdentity("r"), totals=RunTotals(request_throughput=throughput),
                      latency={"p50_ttft_ms": ttft50, "p95_ttft_ms": ttft95, "p50_itl_ms": itl50, "p50_e2el_ms": e2e50,
                               "p95_e2el_ms": e2e95, "mean_itl_ms": itl_mean},
                      server=ServerSummary(True, {"num_preemptions": preempt}))


def test_relative_error_is_signed_and_undefined_only_against_zero() -> None:
    assert relative_error(10.0, 12.0) == pytest.approx(0.2)
    assert relative_error(10.0, 8.0) == pytest.approx(-0.2)
    assert relative_error(0.0, 0.0) == 0.0
    assert relative_error(0.0, 3.0) is None and relative_error(None, 1.0) is None


def test_compare_takes_every_metric_from_the_summaries() -> None:
    measured = summary(2.0, 100.0, 400.0, 20.0, 3000.0, 4.0)
    simulated = summary(2.2, 90.0, 500.0, 20.0, 2400.0, 0.0, e2e50=1050.0, itl_mean=24.2)
    errors = {e.key: e.relative_error for e in compare(measured, simulated)}
    assert list(errors) == [key for key, _ in METRICS]
    assert errors == pytest.approx({"request_throughput": 0.1, "p50_ttft_ms": -0.1, "p95_ttft_ms": 0.25,
                                    "p50_itl_ms": 0.0, "mean_itl_ms": 0.1, "p50_e2el_ms": 0.05,
                                    "p95_e2el_ms": -0.2, "num_preemptions": -1.0})


def test_runs_with_identical_replays_are_compared_as_one_against_their_mean() -> None:
    twin = summary(2.0, 100.0, 400.0, 20.0, 3000.0, 0.0)
    runs = [RunValidation(f"rep{k}", f"rep{k}", 1.0, compare(summary(2.0, m, 4 * m, 20.0, 3000.0, 0.0), twin))
            for k, m in ((1, 90.0), (2, 120.0))]
    other = RunValidation("other", "other", 2.0, compare(twin, summary(2.1, 1.0, 1.0, 1.0, 1.0, 0.0)))
    (group,) = repeat_means([runs[0], other, runs[1]])
    assert group.run_dirs == ("rep1", "rep2") and group.label == "mean of 2 repeats"
    errors = {e.key: e for e in group.errors}
    assert errors["p50_ttft_ms"].measured == 105.0 and errors["p95_ttft_ms"].measured == 420.0
    assert errors["p50_ttft_ms"].relative_error == pytest.approx(100.0 / 105.0 - 1)
    assert errors["request_throughput"].relative_error == 0.0
    assert repeat_means(runs[:1] + [other]) == []  # no repeats, no group


def _trace(path: pathlib.Path) -> pathlib.Path:
    assert cli.main(["trace", "make", "--mix", "chat=0.7,long=0.3", "--num-requests", "30", "--seed", "3",
                     "--out", str(path), "--max-model-len", "2048"]) == 0
    return path


def _measured(tmp_path: pathlib.Path, trace: pathlib.Path, name: str, rate: str) -> pathlib.Path:
    """A run directory standing in for a measured one: a simulation with its marker removed."""
    out = tmp_path / name
    assert cli.main(["simulate", "--trace", str(trace), "--rate", rate, "--seed", "7", "--out-dir", str(out),
                     "--max-num-seqs", "8", "--step-time-base-s", "0.01", "--step-time-per-token-s", "0.00005"]) == 0
    data = json.loads((out / "summary.json").read_text())
    data.pop("simulated")
    (out / "summary.json").write_text(json.dumps(data))
    return out


def _calibration(path: pathlib.Path, runs: tuple[str, ...]) -> pathlib.Path:
    write_calibration(path, Calibration(KEY, StepTimeCoefficients(0.01, 0.0, 5e-5, 5e-5, 0.0), FIT, runs))
    return path


def test_a_run_replayed_with_the_model_that_made_it_has_no_error(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    trace = _trace(tmp_path / "t.jsonl")
    fitted, held = _measured(tmp_path, trace, "fitted", "3"), _measured(tmp_path, trace, "held", "6")
    calibration = _calibration(tmp_path / "calib.json", ("fitted",))
    capsys.readouterr()
    assert cli.main(["simulate", "--validate", str(held), "--calibration", str(calibration),
                     "--out-dir", str(tmp_path / "v")]) == 0
    printed = capsys.readouterr().out
    assert "TTFT p95" in printed and "mean |error|" in printed
    rows = (tmp_path / "v" / "validation.csv").read_text().splitlines()
    assert len(rows) == 1 + len(METRICS)
    for row in rows[1:]:
        error = row.split(",")[-1]
        assert abs(float(error)) < 1e-6, row  # same trace, rate, seed, flags and step model: the same run
    assert (tmp_path / "v" / "validation.md").is_file() and (tmp_path / "v" / "runs" / "held" / "summary.json").is_file()
    assert cli.main(["simulate", "--validate", str(fitted), str(held), "--calibration", str(calibration),
                     "--out-dir", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "fitted on by the calibration" in err and str(fitted) in err
    assert not (tmp_path / "w").exists()  # refused before anything was replayed


def test_repeats_of_one_run_get_a_row_against_their_mean(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    trace = _trace(tmp_path / "t.jsonl")
    repeats = [_measured(tmp_path, trace, f"rep{k}", "6") for k in (1, 2)]
    for run, factor in zip(repeats, (0.9, 1.3)):  # the host drifted: one repeat slower, one faster than the model
        data = json.loads((run / "summary.json").read_text())
        data["p95_ttft_ms"] *= factor
        (run / "summary.json").write_text(json.dumps(data))
    calibration = _calibration(tmp_path / "calib.json", ("fitted",))
    assert cli.main(["simulate", "--validate", *map(str, repeats), "--calibration", str(calibration),
                     "--out-dir", str(tmp_path / "v")]) == 0
    assert "mean of 2 repeats" in capsys.readouterr().out
    with (tmp_path / "v" / "validation.csv").open() as rows:
        group = {r["metric"]: r for r in csv.DictReader(rows) if r["label"] == "mean of 2 repeats"}
    assert group["p95_ttft_ms"]["run_dir"] == f"{repeats[0]};{repeats[1]}"
    assert float(group["p95_ttft_ms"]["relative_error"]) == pytest.approx(1 / 1.1 - 1)  # against the mean, 1.1x
    assert abs(float(group["p50_ttft_ms"]["relative_error"])) < 1e-6


def test_validate_needs_a_calibration(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["simulate", "--validate", str(tmp_path)]) == 2
    assert "--calibration" in capsys.readouterr().err


def test_notes_name_what_the_replay_cannot_reproduce(tmp_path: pathlib.Path) -> None:
    from conveyor.bench.measure.cache_summary import CacheSummary
    from conveyor.bench.measure.rundirs import RunResult
    from conveyor.sim.validate import replay_notes
    fixed = {"server_name": "vllm", "server_flags": {"speculative_config": '{"method": "ngram"}',
                                                     "max_num_queued_tokens": "none"}}
    run = RunResult(tmp_path, "r", RunSummary(RunIdentity("r"), fixed=fixed, cache=CacheSummary(mode="warm")))
    notes = replay_notes(run)
    assert len(notes) == 3 and "warmed" in notes[0] and "vllm" in notes[1] and "speculative decoding" in notes[2]


def test_a_relative_trace_path_is_found_above_the_run(tmp_path: pathlib.Path) -> None:
    from conveyor.sim.validate import find_trace
    (tmp_path / "t.jsonl").write_text("{}\n")
    run_dir = tmp_path / "runs" / "rate-1"
    run_dir.mkdir(parents=True)
    assert find_trace(run_dir, pathlib.Path("t.jsonl"), "r") == tmp_path / "t.jsonl"
    with pytest.raises(ValueError, match="not found"):
        find_trace(run_dir, pathlib.Path("missing.jsonl"), "r")


def test_target_gpu_validates_a_calibration_of_one_gpu_on_runs_of_another(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 36's cross-GPU error: an H100 calibration, scaled to the H200 by the catalog's ratios, against
    runs measured on the H200. Here the "H200 run" was made with exactly the scaled step model (the
    per-step term times H100/H200 bandwidth, 3.35/4.8; the token terms unchanged: equal dense FLOP/s), so
    the scaled replay has no error and the unscaled one overstates every latency."""
    monkeypatch.chdir(tmp_path)
    trace = _trace(tmp_path / "t.jsonl")
    out = tmp_path / "h200-run"
    assert cli.main(["simulate", "--trace", str(trace), "--rate", "6", "--seed", "7", "--out-dir", str(out),
                     "--max-num-seqs", "8", "--step-time-base-s", str(0.01 * 3.35 / 4.8),
                     "--step-time-per-token-s", "0.00005"]) == 0
    data = json.loads((out / "summary.json").read_text())
    data.pop("simulated")
    (out / "summary.json").write_text(json.dumps(data))
    h100 = CalibrationKey("NVIDIA H100 80GB HBM3 x1", "tiny (abc)", "bfloat16", (("device", "cuda"),))
    calibration = tmp_path / "calib.json"
    write_calibration(calibration, Calibration(h100, StepTimeCoefficients(0.01, 0.0, 5e-5, 5e-5, 0.0), FIT, ("x",)))
    capsys.readouterr()
    errors = {}
    for name, extra in (("scaled", ["--target-gpu", "H200"]), ("unscaled", [])):
        assert cli.main(["simulate", "--validate", str(out), "--calibration", str(calibration),
                         "--out-dir", str(tmp_path / name), *extra]) == 0
        with (tmp_path / name / "validation.csv").open() as f:
            errors[name] = {row["metric"]: float(row["relative_error"]) for row in csv.DictReader(f)}
    assert "scaled H100 -> H200" in capsys.readouterr().out
    assert all(abs(e) < 1e-6 for e in errors["scaled"].values()), errors["scaled"]
    assert errors["unscaled"]["p95_e2el_ms"] > 0.05 and errors["unscaled"]["p50_itl_ms"] > 0.05


def test_prompts_are_replayed_as_long_as_the_server_counted_them(tmp_path: pathlib.Path) -> None:
    """The server's tokenizer counts a generated prompt's words one token off now and then; the replay takes
    the server's count from requests.jsonl (a block boundary, and so a preemption, can hang on one token)."""
    from conveyor.bench.measure.rundirs import RunResult
    from conveyor.bench.trace.traces import read_trace
    from conveyor.sim.validate import with_counted_prompts
    trace = read_trace(_trace(tmp_path / "t.jsonl"))
    first, second = trace.requests[0], trace.requests[1]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rows = [{"request_id": first.request_id, "status": "completed", "sent_s": 0.0, "prompt_tokens": first.prompt_len + 1},
            {"request_id": second.request_id, "status": "failed", "sent_s": 0.1, "prompt_tokens": 0}]
    (run_dir / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = RunResult(run_dir, "r", RunSummary(RunIdentity("r")))
    counted = with_counted_prompts(trace, run)
    assert counted.requests[0].prompt_len == first.prompt_len + 1
    assert counted.requests[1:] == trace.requests[1:]  # not counted (failed before a token): the trace's length
    assert with_counted_prompts(trace, RunResult(tmp_path, "none", RunSummary(RunIdentity("r")))) == trace
