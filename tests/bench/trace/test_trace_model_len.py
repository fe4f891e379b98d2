"""`trace make --max-model-len`: every request fits the target server as it will be sent (issue 33 item 6)."""

from __future__ import annotations

import json
import pathlib

import pytest

from conveyor.bench.trace.model_len import TOKEN_MARGIN, TURN_MARGIN, fit_requests
from conveyor.bench.trace.traces import TraceRequest, dispatch_units, read_trace
from conveyor.cli import main


def _sent_lengths(requests: list[TraceRequest]) -> list[int]:
    """Worst-case prompt + output of each request as sent: a turn with every earlier input and full answer."""
    out, history = [], {}
    for r in requests:
        before = history.get(r.session_id, 0) + TURN_MARGIN if r.turn else 0
        out.append(before + r.prompt_len + r.output_len)
        if r.turn is not None:
            history[r.session_id] = before + r.prompt_len + r.output_len
    return out


def test_the_readme_trace_fits_the_default_server(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t.jsonl"
    argv = ["trace", "make", "--mix", "chat=0.6,long=0.2,agent=0.2", "--num-requests", "200", "--seed", "1",
            "--out", str(out)]
    assert main(argv) == 0
    unbounded = read_trace(out)
    assert sum(n > 2048 for n in _sent_lengths(unbounded.requests)) > 20  # the 28 of 200, and more
    assert main([*argv, "--max-model-len", "2048"]) == 0
    assert "fitted to max_model_len 2048" in capsys.readouterr().out
    fitted = read_trace(out)
    assert max(_sent_lengths(fitted.requests)) <= 2048 - TOKEN_MARGIN
    assert fitted.header.num_requests >= 190 and fitted.header.generator["max_model_len"] == 2048
    long = [r for r in fitted.requests if r.request_class == "long"]
    assert long and max(r.prompt_len for r in long) > 1500  # still long prefills, not clipped away
    dispatch_units(fitted.requests)  # sessions still numbered 0..k-1
    header = json.loads(out.read_text().splitlines()[0])
    assert header["generator"]["config"]["long"]["prompt_len_max"] == 2048 - TOKEN_MARGIN - 160


def test_a_turn_that_cannot_fit_ends_its_session_and_outputs_are_clipped() -> None:
    def turn(k: int, prompt_len: int, output_len: int) -> TraceRequest:
        return TraceRequest(request_id=f"t{k}", request_class="agent", prompt="w " * prompt_len,
                            prompt_len=prompt_len, output_len=output_len, session_id="s", turn=k,
                            think_time_s=0.1 if k else None)
    solo = TraceRequest(request_id="solo", request_class="chat", prompt="w", prompt_len=200, output_len=100)
    huge = TraceRequest(request_id="huge", request_class="chat", prompt="w", prompt_len=400, output_len=10)
    fitted, report = fit_requests([turn(0, 100, 50), solo, turn(1, 50, 100), turn(2, 200, 5), huge], 264)
    assert [r.request_id for r in fitted] == ["t0", "solo", "t1"]
    assert fitted[1].output_len == 256 - 200 and fitted[2].output_len == 256 - (150 + TURN_MARGIN + 50)
    assert (report.num_clipped, report.num_dropped) == (2, 2)


def test_too_small_a_bound_is_a_clear_error(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "make", "--max-model-len", "100", "--out", str(tmp_path / "t.jsonl")]) == 2
    assert "--max-model-len" in capsys.readouterr().err
