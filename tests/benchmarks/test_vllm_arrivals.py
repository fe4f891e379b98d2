"""benchmarks/gpu/vllm_arrivals.py: vLLM 0.24's client send schedule, stamped on a conveyor trace."""

import pathlib

import numpy as np
import pytest
from script_loader import load_script

from conveyor.bench.trace.traces import TraceRequest, make_trace, read_trace, write_trace


def _script():
    return load_script("gpu/vllm_arrivals.py")


def test_send_times_are_vllms_gamma_draws_rescaled_to_end_at_n_over_rate() -> None:
    times = _script().vllm_send_times(480, 16.0, seed=0)
    np.random.seed(0)
    raw = np.cumsum(np.random.exponential(1 / 16.0, size=480))  # gamma(1, θ): the same stream as vLLM's draws
    assert times[-1] == pytest.approx(30.0) and times == pytest.approx(list(raw * 30.0 / raw[-1]))
    assert all(b >= a for a, b in zip(times, times[1:])) and times != _script().vllm_send_times(480, 16.0, seed=1)


def test_the_stamped_trace_replays_and_keeps_its_requests(tmp_path: pathlib.Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    requests = [TraceRequest(f"random-{i}", "random", 10 + i, 5, prompt="a b c") for i in range(4)]
    source = tmp_path / "t.jsonl"
    write_trace(make_trace(requests, 0, {"name": "import"}), source)
    out = tmp_path / "v.jsonl"
    assert _script().main([str(source), "--rate", "2", "--seed", "3", "--out", str(out)]) == 0
    stamped = read_trace(out)  # verifies the new version hash
    assert [r.prompt_len for r in stamped.requests] == [10, 11, 12, 13]
    assert stamped.requests[-1].arrival_s == pytest.approx(2.0)
    assert stamped.header.generator["vllm_arrivals"] == {"rate": 2.0, "seed": 3}
    assert _script().main([str(source), "--rate", "inf", "--out", str(out)]) == 2
    assert "--rate must be a finite number" in capsys.readouterr().err
