"""The front end's share of TTFT, fitted from a step log, the trace it ran and the client's mean TTFT."""

from __future__ import annotations

import json
import pathlib

import pytest
from test_calibrate_step_logs import write_log
from test_step_model import TRUE, synthetic_steps

from conveyor.bench.measure.calibration import read_calibrations
from conveyor.bench.measure.front_end import (
    FrontEnd,
    FrontEndRun,
    LoggedStep,
    fit_front_end,
    match_prefills,
)
from conveyor.bench.trace.traces import TraceRequest, make_trace, write_trace
from conveyor.cli import main


def step(k: int, prefill_reqs: int = 0, prefill_tokens: int = 0, decode_tokens: int = 2) -> LoggedStep:
    """Step k of a back-to-back log of 10 ms steps."""
    return LoggedStep(prefill_reqs, prefill_tokens, decode_tokens, 0.01 * k, 0.01 * k + 0.01)


def async_log() -> list[LoggedStep]:
    """r0 (100 tokens) in step 0, r1 (200) in step 6, r2 (300) in step 8; the rest decode."""
    prefills = {0: (1, 100), 6: (1, 200), 8: (1, 300)}
    return [step(k, *prefills.get(k, (0, 0))) for k in range(10)]


SENDS = (0.0, 0.001, 0.0605)
"""r1 is sent during step 0, so with async scheduling it could have been in step 2: it reached the scheduler
after step 3 ended (39 ms late at least). r2, sent during step 6, is in step 8: on time."""


def test_requests_are_matched_first_come_first_served_and_a_chunk_goes_on() -> None:
    assert match_prefills(async_log(), [100, 200, 300]) == ([0, 6, 8], [0, 6, 8])
    # Two prompts, the second chunked at the 1,024-token budget and finished in the next step.
    chunked = [LoggedStep(2, 1024, 0, 0.0, 0.05), LoggedStep(1, 776, 1, 0.05, 0.08)]
    assert match_prefills(chunked, [1000, 800]) == ([0, 0], [0, 1])
    # A prefix-cache hit (or a re-tokenized prompt) under the budget is not a chunk.
    hit = [LoggedStep(2, 588, 0, 0.0, 0.03), LoggedStep(1, 900, 0, 0.03, 0.08)]
    assert match_prefills(hit, [500, 600, 900]) == ([0, 0, 1], [0, 0, 1])


def test_the_way_in_is_the_least_lateness_and_the_way_out_the_rest_of_the_clients_ttft() -> None:
    engine_ttfts = (0.01 - 0.0, 0.07 - 0.001, 0.09 - 0.0605)  # first-token step end - send
    run = FrontEndRun(tuple(async_log()), SENDS, (100, 200, 300), sum(engine_ttfts) / 3 + 0.02, True)
    fitted = fit_front_end([run])
    assert fitted.out_s == pytest.approx(0.02) and fitted.num_requests == 3
    assert fitted.in_delay_s[0] == 0.0 and fitted.in_delay_s[25] == 0.0
    assert fitted.in_delay_s[-1] == pytest.approx(0.04 - 0.001)
    # Without async scheduling r1 could have been in step 1: it reached the scheduler after step 4 ended.
    assert fit_front_end([FrontEndRun(run.steps, SENDS, run.prompt_lens, run.client_mean_ttft_s, False)]
                         ).in_delay_s[-1] == pytest.approx(0.05 - 0.001)


def test_a_front_end_round_trips_and_bad_ones_are_refused() -> None:
    front = FrontEnd((0.0, 0.003, 0.04), 0.018, 480)
    assert FrontEnd.from_json(front.to_json(), "x") == front
    with pytest.raises(ValueError, match="ascending"):
        FrontEnd((0.01, 0.0), 0.0, 1)
    with pytest.raises(ValueError, match="x: front_end needs"):
        FrontEnd.from_json({"in_delay_s": [0.0, "a"], "out_s": 0.0}, "x")


def test_bench_calibrate_fits_the_front_end_beside_the_step_time(tmp_path: pathlib.Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    fit_log = write_log(tmp_path / "fit.jsonl", synthetic_steps(100, TRUE))
    run_log = write_log(tmp_path / "run.jsonl", [
        {"num_prefill_reqs": s.num_prefill_reqs, "num_prefill_tokens": s.num_prefill_tokens,
         "num_decode_tokens": s.num_decode_tokens, "start_s": 100 + s.start_s, "end_s": 100 + s.end_s}
        for s in async_log()])
    trace = tmp_path / "trace.jsonl"
    write_trace(make_trace([TraceRequest(request_id=f"r{i}", request_class="random", prompt="x", prompt_len=n,
                                         output_len=4, arrival_s=0.5 + sent)
                            for i, (n, sent) in enumerate(zip((100, 200, 300), SENDS))], 0, {"name": "t"}), trace)
    client = tmp_path / "client.json"
    client.write_text(json.dumps({"mean_ttft_ms": 1e3 * (0.01 + 0.069 + 0.0295) / 3 + 20.0}))
    out = tmp_path / "calib.json"
    common = ["bench", "calibrate", "--step-log", str(fit_log), "--hardware", "cpu", "--model", "m",
              "--server-flag", "async_scheduling=true", "--out", str(out), "--front-end", str(run_log), str(trace)]
    assert main([*common, str(client)]) == 0
    (calibration,) = read_calibrations(out)
    assert calibration.front_end is not None and calibration.front_end.out_s == pytest.approx(0.02)
    assert "front end, 3 requests" in capsys.readouterr().out
    client.write_text("{}")
    assert main([*common, str(client)]) == 2
    assert capsys.readouterr().err.strip().startswith("conveyor bench calibrate: error: --front-end:")
