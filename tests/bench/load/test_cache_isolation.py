"""Prefix-cache isolation and hit rate (issue 33 items 1-2): a per-run cache_salt, a warm mode on purpose,
the hit rate from usage or from the server's counters, and the warning when it departs from the trace."""

from __future__ import annotations

import json
import pathlib

import pytest
from bench_fake_server import FakeConfig, FakeServer

from conveyor.bench.cli import run as cli_run
from conveyor.bench.load.cache_mode import new_salt
from conveyor.bench.measure.cache_summary import HIT_RATE_MARGIN, departure_warning
from conveyor.bench.measure.runner import BenchError, BenchRunConfig, run_benchmark
from conveyor.bench.measure.summary import RunSummary, summary_from_json, summary_to_json
from conveyor.bench.trace.prefix_share import expected_hit_rate
from conveyor.bench.trace.traces import TraceRequest, make_trace, write_trace

WORDS = 40


def _req(i: int, shared: int = 0, **kw: object) -> TraceRequest:
    """A 1 + WORDS word prompt whose first `shared` words after 'ok' are common to all such requests."""
    words = [f"s{k}" for k in range(shared)] + [f"w{i}x{k}" for k in range(WORDS - shared)]
    return TraceRequest(request_id=f"q{i}", request_class="chat", prompt="ok " + " ".join(words),
                        prompt_len=WORDS + 1, output_len=3, **kw)  # type: ignore[arg-type]


def _trace(tmp_path: pathlib.Path, requests: list[TraceRequest]) -> str:
    path = tmp_path / "trace.jsonl"
    write_trace(make_trace(requests, 0, {"name": "test"}), path)
    return str(path)


def _run(tmp_path: pathlib.Path, server: FakeServer, trace: str, name: str, **kw: object) -> RunSummary:
    cfg = BenchRunConfig(base_url=server.base_url, trace_path=trace, request_rate=100.0,
                         out_dir=str(tmp_path / name), show_progress=False, scrape_interval_s=0.1,
                         max_send_lag_p99_ms=1000.0, **kw)  # type: ignore[arg-type]
    return run_benchmark(cfg)


def _salts(server: FakeServer) -> list[object]:
    return [r.body.get("cache_salt") for r in server.state.received]


def test_every_request_of_a_run_carries_one_salt_and_the_next_run_another(tmp_path: pathlib.Path) -> None:
    session = [TraceRequest(request_id=f"a{k}", request_class="agent", prompt=f"ok turn {k}", prompt_len=3,
                            output_len=2, session_id="a", turn=k, think_time_s=0.01 if k else None) for k in range(3)]
    trace = _trace(tmp_path, [_req(i) for i in range(4)] + session)
    with FakeServer() as server:
        first = _run(tmp_path, server, trace, "one")
        salts_one = _salts(server)
        server.state.received.clear()
        second = _run(tmp_path, server, trace, "two")
        salts_two = _salts(server)
    assert len(salts_one) == 7 and len(set(salts_one)) == 1 and salts_one[0] == first.cache.salt
    assert len(set(salts_two)) == 1 and salts_two[0] == second.cache.salt != first.cache.salt
    assert first.cache.mode == second.cache.mode == "isolated"
    assert len(server.state.probes) == 2  # one probe per run, with its own salt
    assert all(p["cache_salt"] not in (first.cache.salt, second.cache.salt) for p in server.state.probes)
    saved = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert saved["cache"]["mode"] == "isolated" and saved["cache"]["salt"] == first.cache.salt


def test_warm_mode_sends_no_salt_and_replays_the_prompts_first(tmp_path: pathlib.Path) -> None:
    trace = _trace(tmp_path, [_req(i) for i in range(5)])
    with FakeServer(FakeConfig(prompt_details=True)) as server:
        summary = _run(tmp_path, server, trace, "warm", cache_mode="warm")
    assert _salts(server) == [None] * 10 and not server.state.probes
    warm_pass, measured = server.state.received[:5], server.state.received[5:]
    assert all(r.body["max_tokens"] == 1 for r in warm_pass) and all(r.body["max_tokens"] == 3 for r in measured)
    assert summary.cache.mode == "warm" and summary.cache.num_warm_pass_requests == 5
    # every measured prompt was cached by the pass: all words but the last one (the fake's rule)
    assert summary.cache.prefix_cache_hit_rate == pytest.approx(WORDS / (WORDS + 1))
    assert summary.cache.warning is None  # a warm run is meant to hit more than the trace shares


def test_hit_rate_from_usage_when_the_server_reports_cached_tokens(tmp_path: pathlib.Path) -> None:
    trace = _trace(tmp_path, [_req(i, shared=32) for i in range(4)])
    with FakeServer(FakeConfig(prompt_details=True)) as server:
        summary = _run(tmp_path, server, trace, "usage")
    rows = [json.loads(line) for line in (tmp_path / "usage" / "requests.jsonl").read_text().splitlines()]
    cached = [r["cached_tokens"] for r in rows]
    assert sorted(cached) == [0, 33, 33, 33]  # 'ok' + the 32 shared words, after the first request
    assert summary.cache.hit_rate_source == "usage"
    assert summary.cache.prefix_cache_hit_rate == pytest.approx(99 / (4 * (WORDS + 1)))
    assert summary.cache.expected_hit_rate == pytest.approx(3 * 32 / (4 * (WORDS + 1)))  # whole 16-token blocks
    assert summary.cache.warning is None


def test_hit_rate_from_the_server_counters_when_usage_lacks_it(tmp_path: pathlib.Path) -> None:
    trace = _trace(tmp_path, [_req(i, shared=32) for i in range(4)])
    with FakeServer() as server:
        summary = _run(tmp_path, server, trace, "counters")
    rows = [json.loads(line) for line in (tmp_path / "counters" / "requests.jsonl").read_text().splitlines()]
    assert all(r["cached_tokens"] is None for r in rows)
    assert summary.cache.hit_rate_source == "server_metrics"
    assert summary.cache.prefix_cache_hit_rate == pytest.approx(99 / (4 * (WORDS + 1)))
    assert summary.server.value("prefix_cache_hit_rate") == summary.cache.prefix_cache_hit_rate


def test_a_run_that_inherits_a_warm_cache_is_flagged(tmp_path: pathlib.Path) -> None:
    trace = _trace(tmp_path, [_req(i) for i in range(4)])  # no sharing of its own
    with FakeServer(FakeConfig(prompt_details=True, honour_salt=False)) as server:  # the salt is ignored
        first = _run(tmp_path, server, trace, "first")
        second = _run(tmp_path, server, trace, "second")
    assert first.cache.warning is None and first.cache.expected_hit_rate == 0.0
    assert second.cache.prefix_cache_hit_rate == pytest.approx(WORDS / (WORDS + 1))
    assert second.cache.warning is not None and "inherited a warm prefix cache" in second.cache.warning


def test_the_departure_margin() -> None:
    assert departure_warning("isolated", 0.30 + HIT_RATE_MARGIN, 0.30) is None
    assert departure_warning("isolated", 0.31 + HIT_RATE_MARGIN, 0.30) is not None
    assert departure_warning("isolated", 0.0, 0.30) is not None  # cached less than the trace shares
    assert departure_warning("warm", 0.95, 0.30) is None
    assert departure_warning("isolated", None, 0.30) is None
    assert "preemptions" in (departure_warning("isolated", 0.26, 0.0, "server_metrics") or "")
    assert "preemptions" not in (departure_warning("isolated", 0.26, 0.0, "usage") or "")


def test_a_server_refusing_the_salt_stops_the_run_at_once_with_the_way_out(tmp_path: pathlib.Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    trace = _trace(tmp_path, [_req(i) for i in range(3)])
    with FakeServer(FakeConfig(refuse_salt=True)) as server:
        with pytest.raises(BenchError, match="--cache-mode warm"):
            _run(tmp_path, server, trace, "refused")
        assert not server.state.received  # no request of the run was sent
        code = cli_run.run(cli_run_args(server.base_url, trace, tmp_path / "cli"))
        warm = _run(tmp_path, server, trace, "warm", cache_mode="warm")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "cache_salt" in err[0] and "--cache-mode warm" in err[0]
    assert warm.valid and warm.completed == 3


def cli_run_args(base_url: str, trace: str, out: pathlib.Path) -> object:
    import argparse
    parser = argparse.ArgumentParser()
    cli_run.add_arguments(parser)
    return parser.parse_args(["--base-url", base_url, "--trace", trace, "--out", str(out), "--no-progress"])


def test_a_summary_written_before_cache_modes_loads_as_unknown(tmp_path: pathlib.Path) -> None:
    trace = _trace(tmp_path, [_req(i) for i in range(2)])
    with FakeServer() as server:
        data = summary_to_json(_run(tmp_path, server, trace, "new"))
    data.pop("cache")
    old = summary_from_json(data, "old", "old/summary.json")
    assert old.cache.mode == "unknown" and old.cache.prefix_cache_hit_rate is None
    assert summary_to_json(old)["cache"]["mode"] == "unknown"


def test_the_trace_own_sharing_counts_a_session_history_and_common_prefixes() -> None:
    a, b = _req(1, shared=32), _req(2, shared=32)
    assert expected_hit_rate([a, b], block_size=16) == pytest.approx(32 / 82)  # b: 'ok' + 32 words, to 32
    turns = [TraceRequest(request_id=f"t{k}", request_class="agent", prompt="x " * 20, prompt_len=20, output_len=12,
                          session_id="s", turn=k, think_time_s=0.1 if k else None) for k in range(2)]
    # turn 1 is sent with turn 0's 20 + 12 tokens before its own 20: all 32 cached
    assert expected_hit_rate(turns, block_size=16) == pytest.approx(32 / (20 + 52))
    assert expected_hit_rate([], block_size=16) is None


def test_a_salt_keeps_to_characters_every_server_takes() -> None:
    salt = new_salt("continuous@4.5#0/" + "x" * 80)
    assert salt.startswith("conveyor-continuous-4.5-0-") and len(salt) <= 64
    assert all(c.isalnum() or c in "._-" for c in salt) and new_salt("a") != new_salt("a")
