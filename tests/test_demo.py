"""`conveyor demo --quick` end to end: real `conveyor serve` subprocesses, real runs, the full report."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from conveyor.bench.plan.memory import kv_capacity, load_shape
from conveyor.bench.report.report_html import SECTION_IDS

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"
SERVER_EXTRAS = ("torch", "fastapi", "uvicorn", "gguf", "tokenizers", "prometheus_client")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_demo_quick_writes_every_section(tmp_path: pathlib.Path) -> None:
    missing = [m for m in SERVER_EXTRAS if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"conveyor serve cannot start without {missing} (pip install conveyor[engine,server])")
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    result = subprocess.run([sys.executable, "-m", "conveyor", "demo", "--quick", "--out", str(tmp_path)],
                            capture_output=True, text=True, env=env, timeout=880)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "Recommendation" in result.stdout and "Checklist:" in result.stdout and "Diagnosis" in result.stdout
    assert "Demo recommendation:" in result.stdout and "Confidence:" in result.stdout
    assert "\r" not in result.stderr  # not a terminal: one line per event, no redraws
    assert "[demo] calibrating" in result.stderr and "run 1/4 done" in result.stderr  # progress throughout
    page = (tmp_path / "report" / "report.html").read_text()
    for section in SECTION_IDS:
        assert f'id="{section}"' in page
    assert page.count("data:image/png;base64,") == 4  # self-contained
    for name in ("throughput", "latency", "timeseries", "per_class"):
        assert (tmp_path / "report" / "plots" / f"{name}.png").stat().st_size > 10_000
    for config in ("continuous", "static"):
        config_dir = tmp_path / "study" / config
        assert (config_dir / "server.log").is_file() and (config_dir / "command.txt").is_file()
        assert "conveyor serve" in (config_dir / "command.txt").read_text()
        summaries = list(config_dir.glob("rate-*/summary.json"))
        assert summaries
        fixed = json.loads(summaries[0].read_text())["fixed"]
        assert fixed["server_name"] == "conveyor" and fixed["weights_sha256"] and fixed["gpu_name"] == "cpu"
    _plan_matches_serve(tmp_path / "study" / "continuous" / "server.log")


def _plan_matches_serve(server_log: pathlib.Path) -> None:
    """`conveyor plan --kv-cache-memory` predicts the block count `conveyor serve` logged (within 5%)."""
    match = re.search(r"KV cache: (\d+) blocks", server_log.read_text())
    assert match, "conveyor serve no longer logs its KV capacity"
    shape = load_shape(pathlib.Path(__file__).parent / "bench" / "fixtures" / "models" / "smollm2-135m")
    planned = kv_capacity(shape, 256 * 2**20, 16, "float32").num_blocks  # the demo's --kv-cache-memory 256MiB
    assert abs(planned - int(match.group(1))) <= 0.05 * planned


def test_demo_study_and_calibration_arithmetic(tmp_path: pathlib.Path) -> None:
    """Without a server: the configurations, the objective and the rates the calibration yields."""
    import argparse

    from conveyor import demo

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    cfg = demo.config_from_args(parser.parse_args(["--out", str(tmp_path), "--quick"]))
    assert cfg.rate_factors == (0.6, 3.0) and not cfg.budget_variant and cfg.max_repeats == 1
    three = demo.config_from_args(parser.parse_args(["--out", str(tmp_path), "--rate-factors", "0.5,1,3"]))
    assert three.rate_factors == (0.5, 1.0, 3.0)
    for bad in ("0.5,x", "0,1"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--rate-factors", bad])
    full = demo.config_from_args(parser.parse_args(["--out", str(tmp_path)]))
    trace = demo.write_demo_trace(full)
    spec = demo.demo_spec(full, trace)
    assert [(v.name, v.changed) for v in spec.variants] == [
        ("continuous", None), ("static", "batching"), ("budget64", "max_num_batched_tokens")]
    assert "-m conveyor serve --port {port}" in spec.command and spec.command.endswith("{args}")
    assert spec.run_options["num_requests"] == full.num_requests == 40 and spec.sweep.max_repeats == 2
    if demo.embedded_model_path() is not None:  # served from its file, so every run records its hash
        assert f"--model {demo.embedded_model_path()}" in spec.command
    bursts = [{"request_throughput": 1.5, "p95_ttft_ms": 900.0, "p95_e2el_ms": 3000.0},
              {"request_throughput": 2.5, "p95_ttft_ms": 1100.0, "p95_e2el_ms": 5000.0}]
    from conveyor.bench.measure.summary import summary_from_json
    tuned = demo.calibrated(spec, full, [summary_from_json(b, "burst", "test") for b in bursts])  # averaged
    assert tuned.slo.ttft_p95_ms == 2000 and tuned.slo.e2e_p95_ms == 8000 and tuned.slo.error_rate == 0.1
    assert tuned.rates == (1.0, 6.0) and tuned.sweep.slo == tuned.slo and tuned.main_rate == 1.0
    assert len(trace.read_text().splitlines()) == 1 + full.num_requests  # header + requests
    from conveyor.bench.trace.traces import read_trace
    bursts = [read_trace(p) for p in demo.write_burst_traces(trace, tmp_path)]
    assert [len(b.requests) for b in bursts] == [8, 8]  # each carries long prompts, none shared
    assert all(b.header.classes.get("long", 0) >= 1 for b in bursts)
    assert not {r.request_id for r in bursts[0].requests} & {r.request_id for r in bursts[1].requests}


def test_demo_recommendation_survives_reversed_run_order(tmp_path: pathlib.Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 33 item 7, the decision half, without a server: the demo's interleaved rounds over a fake engine
    (static batching makes arrivals wait; the small budget is close to the baseline) recommend the same
    configuration, with the same confidence, when the configurations run last to first."""
    import dataclasses
    import io
    import random

    from conveyor import demo
    from conveyor.bench.decide.slo import SLO
    from conveyor.bench.decide.study import study_record
    from conveyor.bench.load.progress import ProgressReporter
    from conveyor.bench.measure.rundirs import STUDY_FILE
    from conveyor.bench.measure.summary import summary_from_json
    from conveyor.bench.report.dashboard import ReportInputs, analyze

    def fake_engine(template):  # type: ignore[no-untyped-def]
        name = template.label
        ttft = {"continuous": 200.0, "static": 2500.0, "budget64": 260.0}[name]

        def run(rate: float, repeat: int, run_dir: pathlib.Path, num_requests: int | None = None):  # type: ignore[no-untyped-def]
            noise = random.Random(f"{name}/{rate}/{repeat}").uniform(0.9, 1.1)
            over = rate > 2.0  # 3 C: a backlog, so the latencies blow up
            summary = {"label": f"{name}@{rate:g}#{repeat}", "request_rate": rate, "num_prompts": 40,
                       "completed": 40, "duration": 40 / rate, "request_throughput": rate if not over else 2.0,
                       "p95_ttft_ms": noise * ttft * (10 if over else 1), "p95_e2el_ms": noise * 1000.0,
                       "error_rate": 0.0, "valid": True, "server": {}}
            run_dir.mkdir(parents=True)
            (run_dir / "summary.json").write_text(json.dumps(summary))
            return summary_from_json(summary, run_dir.name, "fake")
        return run

    monkeypatch.setattr(demo, "make_run_fn", fake_engine)
    cfg = demo.DemoConfig(out_dir=tmp_path)
    slo = SLO(ttft_p95_ms=1000, e2e_p95_ms=4000, error_rate=0.1)
    spec = dataclasses.replace(demo.demo_spec(cfg, tmp_path / "trace.jsonl"), slo=slo, rates=(0.5, 3.0),
                               main_rate=0.5)
    spec = dataclasses.replace(spec, sweep=dataclasses.replace(spec.sweep, slo=slo))
    answers = []
    for reverse in (False, True):
        study_dir = tmp_path / ("reverse" if reverse else "forward")
        study_dir.mkdir()
        (study_dir / STUDY_FILE).write_text(json.dumps(study_record(spec)))
        urls = {v.name: "http://fake" for v in spec.variants}
        demo._interleaved(spec, urls, study_dir, ProgressReporter(None, stream=io.StringIO()), reverse)
        analysis = analyze(ReportInputs((study_dir,)))
        answers.append((analysis.recommendation.recommended, analysis.recommendation.outcome, analysis.headline,
                        [i.answer for i in analysis.checklist]))
    assert answers[0] == answers[1]
    assert answers[0][0] == "continuous" and "no price given" in answers[0][2], answers[0]
