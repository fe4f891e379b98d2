"""Session turns: sent in order, each after the previous answer plus its think time, carrying the history
with the answers the server actually streamed; per-turn results in the summary."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
from bench_fake_server import FakeConfig, FakeServer

from conveyor.bench.measure.runner import BenchRunConfig, run_benchmark
from conveyor.bench.measure.summary import summary_to_json
from conveyor.bench.trace.traces import TraceError, TraceRequest, dispatch_units, make_trace, write_trace


def run_to_json(cfg: BenchRunConfig) -> dict[str, Any]:
    """One run; its summary as summary.json holds it (these tests assert on the file's keys)."""
    return summary_to_json(run_benchmark(cfg))

THINK_S = 0.05


def _turn(session: str, k: int, output_len: int = 3) -> TraceRequest:
    return TraceRequest(request_id=f"{session}-t{k}", request_class="agent", prompt=f"ok question {k} of {session}",
                        prompt_len=4, output_len=output_len, session_id=session, turn=k,
                        think_time_s=THINK_S if k else None)


def _run(tmp_path: pathlib.Path, server: FakeServer, requests: list[TraceRequest], **kw: object) -> dict:
    path = tmp_path / "trace.jsonl"
    write_trace(make_trace(requests, 0, {"name": "test"}), path)
    cfg = BenchRunConfig(base_url=server.base_url, trace_path=str(path), out_dir=str(tmp_path / "run"),
                         show_progress=False, scrape_interval_s=0.2, max_send_lag_p99_ms=1000.0, **kw)  # type: ignore[arg-type]
    return run_to_json(cfg)


def _answer(output_len: int) -> str:
    return "".join(f" t{i}" for i in range(output_len))  # what the fake server streams


def test_chat_turns_arrive_in_order_after_the_answer_with_the_history(tmp_path: pathlib.Path) -> None:
    # interleaved in the file, as a trace of concurrent users is; plus one standalone request
    requests = [_turn("a", 0), _turn("b", 0), _turn("a", 1), _turn("b", 1), _turn("a", 2),
                TraceRequest(request_id="solo", request_class="chat", prompt="ok alone", prompt_len=2, output_len=2)]
    with FakeServer(FakeConfig(token_delay_s=0.01)) as server:
        summary = _run(tmp_path, server, requests, endpoint="chat")
        received = {rec.body["messages"][-1]["content"]: rec for rec in server.state.received}
    assert summary["completed"] == 6 and summary["num_sessions"] == 2
    for sid, num_turns in (("a", 3), ("b", 2)):
        for k in range(1, num_turns):
            this, prev = received[f"ok question {k} of {sid}"], received[f"ok question {k - 1} of {sid}"]
            assert prev.ended_s is not None and this.arrived_s >= prev.ended_s + THINK_S * 0.9
            expected = prev.body["messages"] + [{"role": "assistant", "content": _answer(3)},
                                                {"role": "user", "content": f"ok question {k} of {sid}"}]
            assert this.body["messages"] == expected  # the whole history, with the answer actually received
    per_turn = summary["per_turn"]
    assert set(per_turn) == {"0", "1", "2"} and per_turn["0"]["completed"] == 2 and per_turn["2"]["completed"] == 1
    assert per_turn["0"]["mean_prompt_tokens"] < per_turn["1"]["mean_prompt_tokens"] < per_turn["2"]["mean_prompt_tokens"]
    lines = [json.loads(x) for x in (tmp_path / "run" / "requests.jsonl").read_text().splitlines()]
    assert {(x["session_id"], x["turn"]) for x in lines if x["turn"] is not None} == {
        ("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1)}


def test_completions_turns_extend_the_previous_prompt_and_answer(tmp_path: pathlib.Path) -> None:
    with FakeServer(FakeConfig(token_delay_s=0.002)) as server:
        _run(tmp_path, server, [_turn("s", k, output_len=2) for k in range(3)], endpoint="completions")
        prompts = [rec.body["prompt"] for rec in server.state.received]
    assert prompts[0] == "ok question 0 of s"
    for k in (1, 2):
        assert prompts[k] == prompts[k - 1] + _answer(2) + "\n" + f"ok question {k} of s"


def test_sessions_keep_their_turns_under_a_concurrency_cap(tmp_path: pathlib.Path) -> None:
    requests = [_turn(s, k) for s in "abcd" for k in range(3)]
    with FakeServer(FakeConfig(token_delay_s=0.003)) as server:
        summary = _run(tmp_path, server, requests, endpoint="chat", max_concurrency=2)
        assert server.state.max_in_flight <= 2
    assert summary["completed"] == 12 and summary["client"]["peak_in_flight"] <= 2


def test_turn_numbering_is_checked() -> None:
    with pytest.raises(TraceError, match="turns must be numbered"):
        dispatch_units([_turn("a", 0), _turn("a", 2)])
    with pytest.raises(TraceError, match="turn needs a session_id"):
        TraceRequest(request_id="x", request_class="c", prompt="p", prompt_len=1, output_len=1, turn=0)
    units = dispatch_units([_turn("a", 1), _turn("b", 0), _turn("a", 0)])
    assert [[r.request_id for r in u] for u in units] == [["a-t0", "a-t1"], ["b-t0"]]
