"""What a person reads: units and precision, a self-contained page, progress lines, retries, fixed things."""

from __future__ import annotations

import asyncio
import io
import json
import math
import pathlib
import re
import shutil

import pytest
from aiohttp import web

from conveyor.bench.decide.slo import SLO, describe_objective
from conveyor.bench.load.progress import ProgressReporter
from conveyor.bench.load.retry import RetryLog, RetryPolicy, new_retrying_session, retry_after_s
from conveyor.bench.measure.fixed import ServerView, collect_fixed
from conveyor.bench.measure.intervals import Interval, IntervalMethod
from conveyor.bench.measure.prom_text import Snapshot
from conveyor.bench.measure.rundirs import RunDirError, prepare_out_dir
from conveyor.bench.report.dashboard import ReportInputs, analyze
from conveyor.bench.report.report_format import fmt_interval
from conveyor.bench.report.write import write_report
from conveyor.bench.units import fmt_ms, fmt_rate

STUDY = pathlib.Path(__file__).parents[1] / "fixtures" / "study_ab"


def test_numbers_have_units_and_no_scientific_notation() -> None:
    assert fmt_ms(14490.3) == "14,490 ms" and fmt_ms(12.345) == "12.3 ms" and fmt_rate(0.00012) == "0.00012"
    ci = Interval(1376.0, 1200.0, 1500.0, 0.95, IntervalMethod.BOOTSTRAP_REQUESTS, 40)
    assert fmt_interval(1376.0, ci, "ms") == "1,376 ms [1,200, 1,500]"
    unbounded = Interval(900.0, 800.0, math.inf, 0.95, IntervalMethod.BOOTSTRAP_REQUESTS, 12)
    assert fmt_interval(900.0, unbounded, "ms") == "900 ms [800, ...]"
    bucket = Interval(300.0, 0.0, 300.0, 0.95, IntervalMethod.HISTOGRAM_BUCKET, 40)
    assert fmt_interval(None, bucket, "ms") == "<= 300 ms"
    assert describe_objective(SLO(ttft_p95_ms=500, error_rate=0.01, tpot_ms=50)) == (
        "p95 TTFT at most 500 ms, error rate at most 1%; a response is accepted when TPOT <= 50 ms.")


def test_html_is_self_contained_and_greys_invalid_runs(tmp_path: pathlib.Path) -> None:
    shutil.copytree(STUDY, tmp_path / "study")
    path = tmp_path / "study" / "continuous" / "rate-2-rep1" / "summary.json"
    summary = json.loads(path.read_text())
    path.write_text(json.dumps({**summary, "valid": False, "invalid_reason": "client CPU saturated: 97%"}))
    page = write_report(analyze(ReportInputs((tmp_path / "study",))), tmp_path / "out")["html"].read_text()
    assert page.count("data:image/png;base64,") == 4 and 'src="plots/' not in page
    assert '<tr class="invalid">' in page and "INVALID (client CPU saturated)" in page
    text = re.sub(r"data:image/png;base64,[^\"]+", "", page)
    assert "Confidence:" in text and "p95 TTFT at most 500 ms" in text and not re.search(r"\de[+-]\d", text)


def test_progress_off_a_terminal_is_one_line_per_event() -> None:
    stream = io.StringIO()
    reporter = ProgressReporter(3, stream)
    reporter("[sweep a] 1 req/s: MET")
    reporter.run_done("a/rate-1-rep0 (40 completed)")
    reporter.close()
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue() and len(lines) == 2
    assert lines[0].endswith("[sweep a] 1 req/s: MET") and lines[1].endswith("run 1/3 done: a/rate-1-rep0 (40 completed)")


def test_out_refuses_to_overwrite_a_run_unless_forced(tmp_path: pathlib.Path) -> None:
    prepare_out_dir(tmp_path / "new", force=False)  # absent: fine
    (tmp_path / "empty").mkdir()
    prepare_out_dir(tmp_path / "empty", force=False)  # holds no run: fine
    run = tmp_path / "run"
    (run / "rate-1-rep0").mkdir(parents=True)
    (run / "rate-1-rep0" / "summary.json").write_text("{}")
    with pytest.raises(RunDirError, match="--force"):
        prepare_out_dir(run, force=False)
    prepare_out_dir(run, force=True)
    assert not run.exists()


def test_retry_after_is_honoured_and_counted() -> None:
    policy = RetryPolicy(max_retries=3, max_wait_s=0.05)
    assert retry_after_s("2", policy) == 0.05 and retry_after_s("0", policy) == 0.0
    assert retry_after_s(None, RetryPolicy(max_retries=1)) == 1.0 and retry_after_s("soon", policy) == 0.05
    attempts: dict[str, int] = {}

    async def handler(request: web.Request) -> web.Response:
        rid = request.headers["x-request-id"]
        attempts[rid] = attempts.get(rid, 0) + 1
        if attempts[rid] <= 2:
            return web.Response(status=503, headers={"Retry-After": "0"}, text="queue full")
        return web.Response(text="ok")

    async def scenario() -> tuple[int, int, RetryLog]:
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        log = RetryLog()
        url = f"http://127.0.0.1:{port}/v1/completions"
        async with new_retrying_session(policy, log) as session:
            async with session.post(url, headers={"x-request-id": "a"}) as ok:
                first = ok.status
            async with new_retrying_session(RetryPolicy(max_retries=1), RetryLog()) as short:
                async with short.post(url, headers={"x-request-id": "b"}) as gave_up:
                    second = gave_up.status
        await runner.cleanup()
        return first, second, log

    first, second, log = asyncio.run(scenario())
    assert first == 200 and second == 503  # b: one retry allowed, still 503
    assert log.retries_by_request == {"a": 2} and log.summary(policy)["num_retries"] == 2


def test_fixed_things_from_the_server_and_local_files(tmp_path: pathlib.Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF weights")
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"version": 1}\n')
    snapshot = Snapshot.from_text('conveyor:config_info{device="cpu",dtype="auto",model_name="m"} 1\n')
    view = ServerView({"data": [{"id": "m", "owned_by": "conveyor"}]}, {"version": "0.1.0"}, snapshot, local=True)
    fixed = collect_fixed(view, {"model": str(gguf), "device": "cpu", "dtype": "auto", "tokenizer": "none"}, str(trace))
    assert fixed["server_name"] == "conveyor" and fixed["server_version"] == "0.1.0" and fixed["gpu_name"] == "cpu"
    assert fixed["weights_sha256"] == fixed["tokenizer_sha256"] and len(fixed["weights_sha256"]) == 64
    assert fixed["trace_sha256"] and fixed["server_flags"]["dtype"] == "auto"
    remote = collect_fixed(ServerView(None, None, None, local=False), {}, str(tmp_path / "missing.jsonl"))
    assert all(remote[k] is None for k in ("server_name", "weights_sha256", "gpu_name", "trace_sha256"))
    reported = Snapshot.from_text('conveyor:model_info{model_path="/m",weights_sha256="ab",tokenizer_sha256="cd",'
                                  'config_sha256="ef",dtype="bfloat16"} 1\nconveyor:gpu_info{name="NVIDIA H200",count="8"} 1\n')
    from_server = collect_fixed(ServerView(None, None, reported, local=False), {}, str(trace))
    assert (from_server["weights_sha256"], from_server["model_config_sha256"], from_server["dtype"]) == ("ab", "ef", "bfloat16")
    assert (from_server["gpu_name"], from_server["gpu_count"], from_server["model_path"]) == ("NVIDIA H200", 8, "/m")


@pytest.mark.skipif(not any(shutil.which(b) for b in ("chromium", "chromium-browser")),
                    reason="headless Chromium not installed (apt-get install -y chromium): optional check")
def test_html_renders_in_headless_chromium(tmp_path: pathlib.Path) -> None:
    """Screenshot-level: the page renders tall, with ink and coloured plots (benchmarks/report_screenshot.sh)."""
    import subprocess
    paths = write_report(analyze(ReportInputs((STUDY,))), tmp_path / "out")
    script = pathlib.Path(__file__).resolve().parents[3] / "benchmarks" / "report_screenshot.sh"
    result = subprocess.run(["bash", str(script), str(paths["html"]), str(tmp_path / "shot.png")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
