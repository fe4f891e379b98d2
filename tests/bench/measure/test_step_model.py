"""The step-time fit recovers known coefficients; calibration files round-trip and are keyed."""

from __future__ import annotations

import json
import pathlib
import random

import pytest

from conveyor.bench.measure.calibration import (
    ASYNC_FIT_WINDOW,
    Calibration,
    CalibrationError,
    CalibrationKey,
    calibrate,
    read_calibrations,
    run_paces,
    write_calibration,
)
from conveyor.bench.measure.step_model import (
    SPREAD_POINTS,
    TERMS,
    StepSample,
    StepTimeCoefficients,
    between_steps_s,
    fit_step_model,
    pace,
    step_spread,
)
from conveyor.cli import main

TRUE = StepTimeCoefficients(per_step_s=0.012, per_seq_s=4e-5, per_prefill_token_s=6e-5, per_decode_token_s=9e-5,
                            per_context_token_s=2e-8)
FIXED = {"gpu_name": "NVIDIA H100 80GB HBM3", "gpu_count": 1, "dtype": "bfloat16", "weights_sha256": "ab" * 32,
         "model_path": "/m/llama.gguf", "server_flags": {"model_name": "llama", "device": "cuda", "block_size": "16",
                                                        "max_num_seqs": "256", "tensor_parallel_size": "1"}}


def synthetic_steps(n: int, coefficients: StepTimeCoefficients, noise: float = 0.0, seed: int = 0) -> list[dict]:
    """Step-log rows of mixed batches (decode-only, prefill-only, mixed) timed by `coefficients`."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        decodes = rng.randint(0, 64)
        prefills = rng.randint(0 if decodes else 1, 3)
        prefill_tokens = sum(rng.randint(16, 512) for _ in range(prefills))
        drafts = rng.choice([0, 0, decodes * 2])
        reach = rng.choice([128, 512, 2048, 8192])  # contexts vary apart from batch size: c1 and c4 separate
        context = prefill_tokens + sum(rng.randint(reach // 2, reach) for _ in range(decodes))
        sample = StepSample(prefills + decodes, prefill_tokens, decodes + drafts, context, 1.0)
        time_s = coefficients.predict_s(sample) * (1.0 + rng.gauss(0.0, noise))
        rows.append({"num_prefill_tokens": prefill_tokens, "num_decode_tokens": decodes + drafts,
                     "num_prefill_reqs": prefills, "num_decode_reqs": decodes, "num_context_tokens": context,
                     "num_draft_tokens": drafts, "num_preemptions": 0, "step_time_s": time_s, "start_s": 0.0})
    return rows


def samples(rows: list[dict]) -> list[StepSample]:
    return [s for s in map(StepSample.from_record, rows) if s is not None]


def test_noise_free_logs_give_the_coefficients_back() -> None:
    coefficients, fit = fit_step_model(samples(synthetic_steps(400, TRUE)))
    assert coefficients.values == pytest.approx(TRUE.values, rel=1e-6)
    assert fit.r2 == pytest.approx(1.0) and fit.p95_rel_error < 1e-6 and fit.num_steps == 400


def test_noisy_logs_give_them_back_within_tolerance() -> None:
    coefficients, fit = fit_step_model(samples(synthetic_steps(4000, TRUE, noise=0.05, seed=2)))
    big_terms = [v for i, v in enumerate(coefficients.values) if i != 1]
    assert big_terms == pytest.approx([v for i, v in enumerate(TRUE.values) if i != 1], rel=0.06)
    # per-sequence cost is the least identified term (decode tokens = decode sequences without drafts)
    assert coefficients.per_seq_s == pytest.approx(TRUE.per_seq_s, rel=0.3)
    assert 0.03 < fit.median_rel_error < 0.05 and fit.r2 > 0.9


def test_coefficients_stay_non_negative_when_a_term_costs_nothing() -> None:
    free_context = StepTimeCoefficients(0.01, 0.0, 5e-5, 1e-4, 0.0)
    coefficients, _ = fit_step_model(samples(synthetic_steps(300, free_context, noise=0.02, seed=2)))
    assert min(coefficients.values) >= 0.0
    assert coefficients.per_context_token_s < 2e-9 and coefficients.per_step_s == pytest.approx(0.01, rel=0.1)


def small_batch_steps(n: int, coefficients: StepTimeCoefficients, seed: int = 0) -> list[dict]:
    """A CPU-like log: mostly decodes of 1 to 5 sequences, some prefills, so one-token steps are common."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        decodes, prefills = rng.randint(1, 5), int(rng.random() < 0.1)
        prefill_tokens = prefills * rng.randint(20, 250)
        context = prefill_tokens + sum(rng.randint(50, 500) for _ in range(decodes))
        sample = StepSample(prefills + decodes, prefill_tokens, decodes, context, 1.0)
        rows.append({"num_prefill_tokens": prefill_tokens, "num_decode_tokens": decodes, "num_prefill_reqs": prefills,
                     "num_decode_reqs": decodes, "num_context_tokens": context,
                     "step_time_s": coefficients.predict_s(sample)})
    return rows


CPU = StepTimeCoefficients(per_step_s=0.004, per_seq_s=0.0016, per_prefill_token_s=1.1e-3, per_decode_token_s=0.0,
                           per_context_token_s=2e-6, per_multi_row_step_s=0.004)
"""Shaped like the embedded model on this CPU: a one-decode step 6 ms, two 12 ms (the one-row kernels' jump)."""


def test_the_jump_from_one_token_rows_to_several_is_fitted_apart() -> None:
    rows = small_batch_steps(600, CPU, seed=1)
    one_decode = StepSample(1, 0, 1, 200, 1.0)
    multi_row = TERMS.index("per_multi_row_step_s")
    assert not one_decode.features[multi_row] and StepSample(2, 0, 2, 400, 1.0).features[multi_row] == 1.0
    assert not StepSample(1, 1, 0, 1, 1.0).features[multi_row]  # one prefill token is one row too
    coefficients, fit = fit_step_model(samples(rows))
    assert coefficients.per_multi_row_step_s == pytest.approx(0.004, rel=1e-4)
    assert coefficients.predict_s(one_decode) == pytest.approx(CPU.predict_s(one_decode), rel=1e-4)
    assert fit.p95_rel_error < 1e-4
    two_decodes = StepSample(2, 0, 2, 400, 1.0)
    assert coefficients.predict_s(two_decodes) - coefficients.predict_s(one_decode) == pytest.approx(0.006, rel=1e-3)


def test_the_multi_row_term_is_fixed_at_zero_when_every_step_has_several_rows() -> None:
    # TRUE's synthetic batches always compute several tokens, so c5 would be c0's twin: it stays 0 and c0 keeps
    # the whole per-step cost (a one-token step, never seen, is priced as before the term existed).
    rows = [r for r in synthetic_steps(300, TRUE, seed=5) if r["num_prefill_tokens"] + r["num_decode_tokens"] > 1]
    coefficients, _ = fit_step_model(samples(rows))
    assert coefficients.per_multi_row_step_s == 0.0
    assert coefficients.per_step_s == pytest.approx(TRUE.per_step_s, rel=1e-6)
    legacy = {k: v for k, v in TRUE.to_json().items() if k != "per_multi_row_step_s"}
    assert StepTimeCoefficients.from_json(legacy, "old file") == TRUE


def cpu_log(n: int, coefficients: StepTimeCoefficients, seed: int = 0) -> list[StepSample]:
    """Shaped like the embedded model's seqs8 logs: mostly 1..8-row decodes, some prompts of 20..260 tokens
    (a few at or under 32 rows: the block kernel's path), some prompts with decodes riding along."""
    rng = random.Random(seed)
    steps = []
    for _ in range(n):
        decodes = rng.choice([1, 1, 1, 2, 2, 3, 4, 5, 6, 8])
        prompt = rng.randint(20, 260) if rng.random() < 0.08 else 0
        decodes = rng.choice([0, decodes]) if prompt else decodes
        context = prompt + sum(rng.randint(50, 400) for _ in range(decodes))
        sample = StepSample(decodes + bool(prompt), prompt, decodes, context, 1.0)
        steps.append(StepSample(sample.num_seqs, prompt, decodes, context, coefficients.predict_s(sample)))
    return steps


SEQS8 = StepTimeCoefficients(per_step_s=0.0095, per_seq_s=0.0, per_prefill_token_s=2.4e-3, per_decode_token_s=2.6e-3,
                             per_context_token_s=2e-6, per_multi_row_step_s=0.0075, per_gemm_step_s=0.045)
"""The seqs8 fit with the GEMM-step term (docs/decision.md, issue 36): a prompt step pays ~45 ms of dequantizing."""


def test_a_cpu_fit_prices_the_gemm_path_apart_from_the_decodes() -> None:
    steps = cpu_log(2000, SEQS8, seed=3)
    assert StepSample(1, 33, 0, 33, 1.0).features[-1] == 1.0 and StepSample(1, 32, 0, 32, 1.0).features[-1] == 0.0
    coefficients, fit = fit_step_model(steps, cpu=True)
    assert coefficients.values == pytest.approx(SEQS8.values, rel=1e-4, abs=1e-9)
    # the fit before the term lends the prompts' fixed cost to the terms the decodes share: two decodes priced
    # 4%+ high, a 40-token prompt 10%+ low (the real logs: 5-12% high, docs/decision.md)
    before, _ = fit_step_model(steps)
    two, short_prompt = StepSample(2, 0, 2, 400, 1.0), StepSample(1, 40, 0, 40, 1.0)
    assert before.per_gemm_step_s == 0.0 and before.predict_s(two) > 1.04 * SEQS8.predict_s(two)
    assert before.predict_s(short_prompt) < 0.9 * SEQS8.predict_s(short_prompt)
    assert coefficients.predict_s(two) == pytest.approx(SEQS8.predict_s(two), rel=1e-4)


def test_the_gemm_term_is_fitted_on_cpu_runs_only(tmp_path: pathlib.Path) -> None:
    rows = [{"num_prefill_tokens": s.num_prefill_tokens, "num_decode_tokens": s.num_decode_tokens,
             "num_prefill_reqs": int(s.num_prefill_tokens > 0), "num_decode_reqs": s.num_decode_tokens,
             "num_context_tokens": s.num_context_tokens, "step_time_s": s.step_time_s} for s in cpu_log(600, SEQS8)]
    cpu_fixed = {**FIXED, "gpu_name": None, "server_flags": {**FIXED["server_flags"], "device": "cpu"}}
    on_cpu = calibrate([write_run(tmp_path / "cpu", rows, cpu_fixed)]).coefficients
    on_gpu = calibrate([write_run(tmp_path / "gpu", rows)]).coefficients
    assert on_cpu.per_gemm_step_s == pytest.approx(SEQS8.per_gemm_step_s, rel=1e-4) and on_gpu.per_gemm_step_s == 0.0
    legacy = {k: v for k, v in SEQS8.to_json().items() if k != "per_gemm_step_s"}
    assert StepTimeCoefficients.from_json(legacy, "old file").per_gemm_step_s == 0.0


def test_too_few_steps_and_untimed_rows_are_refused_or_skipped() -> None:
    with pytest.raises(ValueError, match="at least 7"):
        fit_step_model(samples(synthetic_steps(5, TRUE)))
    assert StepSample.from_record({"num_decode_tokens": 3, "num_decode_reqs": 3}) is None  # no step_time_s
    assert StepSample.from_record({"num_decode_tokens": 0, "step_time_s": 0.01}) is None  # an empty step


def write_run(run_dir: pathlib.Path, rows: list[dict], fixed: dict = FIXED) -> pathlib.Path:
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text(json.dumps({"fixed": fixed}))
    (run_dir / "step_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def test_calibration_is_keyed_and_round_trips(tmp_path: pathlib.Path) -> None:
    runs = [write_run(tmp_path / f"r{i}", synthetic_steps(100, TRUE, seed=i)) for i in range(2)]
    calibration = calibrate(runs)
    key = calibration.key
    assert key.hardware == "NVIDIA H100 80GB HBM3 x1" and key.model == "llama (abababababab)" and key.dtype == "bfloat16"
    assert dict(key.configuration) == {"device": "cuda", "block_size": "16", "tensor_parallel_size": "1"}
    assert calibration.fit.num_steps == 200 and calibration.coefficients.values == pytest.approx(TRUE.values, rel=1e-6)
    path = tmp_path / "calib.json"
    write_calibration(path, calibration)
    assert read_calibrations(path) == [calibration]
    cpu = Calibration(CalibrationKey("cpu", "llama", "float32", ()), TRUE, calibration.fit, ())
    write_calibration(path, cpu)
    write_calibration(path, calibration)  # the same key again: replaced, not added
    assert read_calibrations(path) == [cpu, calibration]
    assert Calibration.from_json(json.loads(json.dumps(cpu.to_json())), "x") == cpu


def test_runs_of_different_setups_are_not_fitted_together(tmp_path: pathlib.Path) -> None:
    h100 = write_run(tmp_path / "h100", synthetic_steps(50, TRUE))
    h200 = write_run(tmp_path / "h200", synthetic_steps(50, TRUE), {**FIXED, "gpu_name": "NVIDIA H200"})
    with pytest.raises(CalibrationError, match="differ"):
        calibrate([h100, h200])
    (tmp_path / "plain").mkdir()
    with pytest.raises(CalibrationError, match="--collect-step-log"):
        calibrate([tmp_path / "plain"])


def test_bench_calibrate_cli(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = write_run(tmp_path / "run", synthetic_steps(60, TRUE))
    out = tmp_path / "calib.json"
    assert main(["bench", "calibrate", str(run), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "per_step = 12 ms" in printed and "R² 1.000" in printed
    assert read_calibrations(out)[0].runs == (str(run),)
    assert main(["bench", "calibrate", str(tmp_path / "missing"), "--out", str(out)]) == 2


def test_held_out_runs_are_measured_not_fitted(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    fitted = write_run(tmp_path / "fit", synthetic_steps(200, TRUE, noise=0.02, seed=3))
    slower = StepTimeCoefficients(*(1.2 * v for v in TRUE.values))  # the held-out run's steps are 20% slower
    held = write_run(tmp_path / "held", synthetic_steps(100, slower, seed=4))
    calibration = calibrate([fitted], [held])
    assert calibration.fit.num_steps == 200 and calibration.fit.median_rel_error < 0.02  # fitted on its own run only
    assert calibration.held_out is not None and calibration.held_out.num_steps == 100
    assert calibration.held_out.median_rel_error == pytest.approx(1 - 1 / 1.2, abs=0.02)
    assert calibration.held_out_runs == (str(held),)
    assert Calibration.from_json(json.loads(json.dumps(calibration.to_json())), "x") == calibration
    out = tmp_path / "calib.json"
    assert main(["bench", "calibrate", str(fitted), "--held-out", str(held), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "held out, 100 steps of 1 run(s)" in printed
    assert "fitted fit 1.00" in printed and "held out held 0.83" in printed  # priced at 1 / 1.2 of what it took
    other = write_run(tmp_path / "other", synthetic_steps(50, TRUE), {**FIXED, "dtype": "float16"})
    with pytest.raises(CalibrationError, match="differ"):
        calibrate([fitted], [other])


def back_to_back(rows: list[dict], gap_s: float, idle_after: tuple[int, ...] = ()) -> list[dict]:
    """`rows` timed as a busy engine logs them: each step starts `gap_s` after the previous one ended (the
    loop's own time), or 2 s later after each index in `idle_after` (the engine sat idle)."""
    start_s, timed = 100.0, []
    for index, row in enumerate(rows):
        timed.append({**row, "start_s": start_s})
        start_s += row["step_time_s"] + (2.0 if index in idle_after else gap_s)
    return timed


def test_the_time_between_steps_is_the_logs_median_gap_not_its_idle_time(tmp_path: pathlib.Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    runs = [write_run(tmp_path / f"r{i}", back_to_back(synthetic_steps(100, TRUE, seed=i), 6e-4, (10, 50, 90)))
            for i in range(2)]
    calibration = calibrate(runs)
    assert calibration.coefficients.between_steps_s == pytest.approx(6e-4)
    assert calibration.coefficients.values == pytest.approx(TRUE.values, rel=1e-6)  # the fit is of step times alone
    assert calibration.fit.p95_rel_error < 1e-6
    path = tmp_path / "calib.json"
    write_calibration(path, calibration)
    assert read_calibrations(path) == [calibration]
    assert main(["bench", "calibrate", *map(str, runs), "--out", str(tmp_path / "c.json")]) == 0
    assert "between steps 0.6 ms" in capsys.readouterr().out
    assert between_steps_s([synthetic_steps(10, TRUE)]) == 0.0  # no start times (start_s 0): nothing measured
    legacy = {k: v for k, v in TRUE.to_json().items() if k != "between_steps_s"}
    assert StepTimeCoefficients.from_json(legacy, "old file").between_steps_s == 0.0



def async_engine_log(settles_s: list[float], gap_s: float, launch_s: float = 1e-3) -> list[dict]:
    """A log as AsyncEngineCore writes it (core/step_log.py): engine call j, `gap_s` after call j-1 ended,
    launches step j, then settles step j-1 for settles_s[j-1]; step j's record starts at its launch, is its
    launch plus its settle long, and ends with call j+1."""
    rows: list[dict] = []
    starts, call_s = [], 100.0
    for step, settle_s in enumerate(settles_s):
        starts.append(call_s)
        if step:
            end_s = call_s + launch_s + settles_s[step - 1]
            rows.append({"num_decode_tokens": 1, "step_time_s": launch_s + settles_s[step - 1],
                         "start_s": starts[step - 1], "launch_time_s": launch_s, "end_s": end_s})
            call_s = end_s + gap_s
        else:
            call_s += launch_s  # a burst starts: the first call goes on to launch the second step
    return rows


def test_between_steps_of_an_async_log_is_the_gap_between_engine_calls() -> None:
    """Settles of 1 and 9 ms in turn: next start - (start + step time) is the gap -8 or +8 ms, a median of
    nothing; from the end of the step settled before, each start is the 0.6 ms gap exactly."""
    log = async_engine_log([1e-3, 9e-3] * 20, 6e-4)
    assert between_steps_s([log]) == pytest.approx(6e-4)
    legacy = [{k: v for k, v in row.items() if k != "end_s"} for row in log]
    assert between_steps_s([legacy]) != pytest.approx(6e-4, abs=1e-4)  # why the end is logged

def shifted_async_log(pairs: int, seed: int = 0) -> list[dict]:
    """Issue 36's H200 logs: an async engine's record before a prefill carries 60% of the prefill's time.
    Pairs of (decode step, then a prefill or another decode), so windows of 2 hold each shifted pair whole."""
    model = StepTimeCoefficients(0.018, 1e-4, 1e-4, 0.0, 0.0)
    rng, rows = random.Random(seed), []
    for _ in range(pairs):
        seqs = rng.randint(20, 120)
        decode = StepSample(seqs, 0, seqs, seqs * 1000, 1.0)
        prefill = rng.random() < 0.5
        second = StepSample(seqs + 1, rng.randint(500, 2000), seqs, seqs * 1000, 1.0) if prefill else decode
        first_s, second_s = model.predict_s(decode), model.predict_s(second)
        moved = 0.6 * second_s if prefill else 0.0
        for sample, time_s in ((decode, first_s + moved), (second, second_s - moved)):
            rows.append({"num_prefill_reqs": 1 if sample.num_prefill_tokens else 0,
                         "num_decode_reqs": sample.num_seqs - (1 if sample.num_prefill_tokens else 0),
                         "num_prefill_tokens": sample.num_prefill_tokens, "num_decode_tokens": sample.num_decode_tokens,
                         "num_context_tokens": sample.num_context_tokens, "step_time_s": time_s})
    return rows


def test_a_window_fit_prices_time_logged_on_the_wrong_neighbour(tmp_path: pathlib.Path) -> None:
    rows = shifted_async_log(200)
    per_step, _ = fit_step_model(samples(rows))
    assert per_step.per_prefill_token_s < 0.8e-4  # the prefill's moved time went to the decode terms
    windowed, fit = fit_step_model(samples(rows), window=2)
    assert windowed.per_prefill_token_s == pytest.approx(1e-4, rel=0.02)
    assert windowed.per_step_s == pytest.approx(0.018, rel=0.02) and fit.num_steps == 400  # errors stay per step
    with pytest.raises(ValueError, match="do not add up"):
        fit_step_model(samples(rows), window=2, run_sizes=[100, 100])
    runs = [write_run(tmp_path / f"r{i}", shifted_async_log(101, seed=i)[:201]) for i in range(2)]  # odd: a partial window each
    calibration = calibrate(runs, window=2)
    assert calibration.coefficients.per_prefill_token_s == pytest.approx(1e-4, rel=0.02)
    write_calibration(tmp_path / "w.json", calibration)
    assert read_calibrations(tmp_path / "w.json") == [calibration] and calibration.fit_window == 2
    assert main(["bench", "calibrate", str(runs[0]), "--fit-window", "0", "--out", str(tmp_path / "c.json")]) == 2


def test_an_async_engines_runs_are_fitted_in_windows_of_8_unless_told(tmp_path: pathlib.Path) -> None:
    served_async = {**FIXED, "server_flags": {**FIXED["server_flags"], "async_scheduling": "true"}}  # as runs write it
    runs = [write_run(tmp_path / f"a{i}", shifted_async_log(101, seed=i)[:201], served_async) for i in range(2)]
    assert dict(calibrate(runs).key.configuration)["async_scheduling"] == "true"
    assert calibrate(runs).fit_window == ASYNC_FIT_WINDOW == 8
    assert calibrate(runs, window=1).fit_window == 1  # --fit-window 1: single steps, as asked
    synchronous = [write_run(tmp_path / "s", synthetic_steps(60, TRUE))]
    assert calibrate(synchronous).fit_window == 1
    assert main(["bench", "calibrate", str(runs[0]), "--out", str(tmp_path / "c.json")]) == 0
    assert read_calibrations(tmp_path / "c.json")[0].fit_window == 8


def test_a_runs_pace_is_its_summed_predicted_over_measured_step_time(tmp_path: pathlib.Path) -> None:
    steady = samples(synthetic_steps(100, TRUE, noise=0.05, seed=6))
    assert pace(TRUE, steady) == pytest.approx(1.0, abs=0.02)  # per-step noise averages out over a run
    slow = [StepSample(s.num_seqs, s.num_prefill_tokens, s.num_decode_tokens, s.num_context_tokens,
                       1.25 * s.step_time_s) for s in steady]
    assert pace(TRUE, slow) == pytest.approx(pace(TRUE, steady) / 1.25)  # a run 25% slower than priced: 0.8
    with pytest.raises(ValueError, match="no logged steps"):
        pace(TRUE, [])
    runs = [write_run(tmp_path / name, synthetic_steps(50, TRUE, seed=seed)) for name, seed in (("a", 7), ("b", 0))]
    paces = run_paces(TRUE, runs)
    assert [run for run, _ in paces] == [str(run) for run in runs] and [v for _, v in paces] == pytest.approx([1.0, 1.0])
    with pytest.raises(CalibrationError, match="--collect-step-log"):
        run_paces(TRUE, [tmp_path / "missing"])


def test_the_spread_is_the_ratio_quantiles_scaled_to_mean_one() -> None:
    model = StepTimeCoefficients(0.01, 0.0, 0.0, 0.0, 0.0)
    samples = [StepSample(1, 0, 1, 0, 0.01 * r) for r in (0.9, 1.0, 1.1, 1.5) * 5]
    spread = step_spread(model, samples)
    assert len(spread) == SPREAD_POINTS and list(spread) == sorted(spread)
    mean = (sum(spread) - (spread[0] + spread[-1]) / 2) / (len(spread) - 1)  # what a uniform draw averages
    assert mean == pytest.approx(1.0)
    assert spread[-1] / spread[0] == pytest.approx(1.5 / 0.9)
    assert step_spread(model, samples[:1]) == ()
