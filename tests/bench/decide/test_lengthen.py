"""A point whose rate was not shown sustained is run longer, never a decided one (issue 33 item 3)."""

from __future__ import annotations

import argparse
import json
import pathlib

import pytest

from conveyor.bench.cli import study as cli_study
from conveyor.bench.cli import sweep as cli_sweep
from conveyor.bench.decide.run_fn import RunTemplate, make_run_fn
from conveyor.bench.decide.slo import SLO
from conveyor.bench.decide.study import spec_from_mapping
from conveyor.bench.decide.sweep import SweepConfig, Sweeper, SweepError
from conveyor.bench.measure import runner
from conveyor.bench.measure.intervals import Interval, IntervalMethod
from conveyor.bench.measure.summary import RunSummary, summary_from_json

SLO_TTFT = SLO(ttft_p95_ms=500)


def _ci(estimate: float, low: float, high: float) -> dict[str, object]:
    return Interval(estimate, low, high, 0.95, IntervalMethod.BOOTSTRAP_REQUESTS, 100).to_json()


class Server:
    """Meets p95 TTFT at every rate; completes `capacity` req/s at most, from a trace of `trace_len` requests
    (a run sends the first `num_requests`, default 100). `ttft_high` widens TTFT's interval past the bound."""

    def __init__(self, capacity: float, trace_len: int = 10_000, ttft_high: float = 350.0) -> None:
        self.capacity, self.trace_len, self.ttft_high = capacity, trace_len, ttft_high
        self.asked: list[int | None] = []

    def __call__(self, rate: float, repeat: int, run_dir: pathlib.Path, num_requests: int | None = None) -> RunSummary:
        self.asked.append(num_requests)
        sent = min(num_requests or 100, self.trace_len)
        done = min(rate, self.capacity)
        summary = {"label": f"s@{rate:g}#{repeat}", "request_rate": rate, "num_prompts": sent, "num_sent": sent,
                   "completed": sent, "duration": sent / rate, "request_throughput": done, "p95_ttft_ms": 300.0,
                   "error_rate": 0.0, "valid": True, "server": {},
                   "ci": {"p95_ttft_ms": _ci(300.0, 250.0, self.ttft_high),
                          "request_throughput": _ci(done, 0.9 * done, 1.05 * done)}}
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "summary.json").write_text(json.dumps(summary))
        return summary_from_json(summary, run_dir.name, "test")  # type: ignore[arg-type]


def _point(tmp_path: pathlib.Path, server: Server, rate: float, lines: list[str] | None = None,
           **kw: object) -> dict[str, object]:
    cfg = SweepConfig(**({"slo": SLO_TTFT, "num_repeats": 1} | kw))  # type: ignore[arg-type]
    sweeper = Sweeper("s", cfg, server, tmp_path, progress=(lines if lines is not None else []).append)
    sweeper.run_point(rate)
    point: dict[str, object] = json.loads((tmp_path / "sweep.json").read_text())["points"][0]
    return point


def test_an_unsustained_point_gets_longer_repeats(tmp_path: pathlib.Path) -> None:
    server, lines = Server(capacity=3.0), []
    point = _point(tmp_path, server, 4.0, lines, max_repeats=3)
    assert "4 req/s: rate not shown sustained; a further repeat sends 200 requests" in "\n".join(lines)
    assert point["status"] == "undecided" and "not sustained" in str(point["failures"])
    assert server.asked == [None, 200, 400]  # each repeat twice the last one's requests
    assert point["num_requests"] == [100, 200, 400]  # sweep.json records each repeat's length


def test_a_decided_point_is_never_lengthened(tmp_path: pathlib.Path) -> None:
    server = Server(capacity=10.0)
    point = _point(tmp_path, server, 2.0, max_repeats=3)
    assert point["status"] == "met" and server.asked == [None]
    both = Server(capacity=10.0)
    assert _point(tmp_path / "b", both, 2.0, num_repeats=2, max_repeats=3)["num_requests"] == [100, 100]


def test_a_straddled_bound_is_repeated_not_lengthened(tmp_path: pathlib.Path) -> None:
    server = Server(capacity=10.0, ttft_high=600.0)  # TTFT's interval straddles 500 ms: more repeats decide
    point = _point(tmp_path, server, 2.0, max_repeats=3)
    assert point["status"] == "undecided" and server.asked == [None, None, None]


def test_max_requests_caps_the_length(tmp_path: pathlib.Path) -> None:
    server = Server(capacity=3.0)
    point = _point(tmp_path, server, 4.0, max_repeats=4, max_requests=250)
    assert server.asked == [None, 200, 250, 250]
    assert "not lengthened past --max-requests 250" in str(point["failures"])


def test_a_short_trace_says_it_cannot_lengthen(tmp_path: pathlib.Path) -> None:
    server, lines = Server(capacity=3.0, trace_len=150), []
    point = _point(tmp_path, server, 4.0, lines, max_repeats=4)
    assert sum("sustained; cannot lengthen" in line for line in lines) == 1  # said once, when it happens
    assert server.asked == [None, 200, 150, 150]  # no longer run exists: the point says so instead
    assert point["num_requests"] == [100, 150, 150, 150]
    assert "cannot lengthen past the trace's 150 requests" in str(point["failures"])


def test_lengthen_factor_one_never_lengthens(tmp_path: pathlib.Path) -> None:
    server = Server(capacity=3.0)
    _point(tmp_path, server, 4.0, max_repeats=3, lengthen_factor=1.0)
    assert server.asked == [None, None, None]


def test_the_settings_are_validated_naming_the_flag() -> None:
    with pytest.raises(SweepError, match="--lengthen-factor"):
        SweepConfig(slo=SLO_TTFT, lengthen_factor=0.5)
    with pytest.raises(SweepError, match="--max-requests"):
        SweepConfig(slo=SLO_TTFT, max_requests=0)


def test_flags_and_study_keys_set_the_lengthening(tmp_path: pathlib.Path) -> None:
    parser = argparse.ArgumentParser()
    cli_sweep.add_sweep_arguments(parser)
    args = parser.parse_args(["--lengthen-factor", "3", "--max-requests", "900"])
    assert cli_sweep.sweep_options_from_args(args) == {"lengthen_factor": 3.0, "max_requests": 900}
    study = {"command": "x {port}", "trace": "t.jsonl", "slo": {"ttft_p95_ms": 500},
             "sweep": {"lengthen_factor": 1.5, "max_requests": 400}}
    spec = spec_from_mapping(study, "t")
    assert (spec.sweep.lengthen_factor, spec.sweep.max_requests) == (1.5, 400)
    path = tmp_path / "study.toml"
    path.write_text('command = "x {port} {args}"\ntrace = "a.jsonl"\n[slo]\nttft_p95_ms = 100\n')
    parser = argparse.ArgumentParser()
    cli_study.add_arguments(parser)
    flags = parser.parse_args([str(path), "--lengthen-factor", "4"])
    assert spec_from_mapping(cli_study.study_mapping(flags), "t").sweep.lengthen_factor == 4.0


def test_make_run_fn_passes_the_length(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[runner.BenchRunConfig] = []
    monkeypatch.setattr(runner, "run_benchmark", lambda cfg: seen.append(cfg))  # type: ignore[func-returns-value]
    run = make_run_fn(RunTemplate("http://127.0.0.1:1", "t.jsonl", "c", options={"num_requests": 50}))
    run(2.0, 0, tmp_path / "a", None)
    run(2.0, 1, tmp_path / "b", 100)
    assert [c.num_requests for c in seen] == [50, 100]
