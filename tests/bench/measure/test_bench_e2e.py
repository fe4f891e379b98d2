"""End to end: `conveyor bench run` against a real `conveyor serve` subprocess (embedded model, CPU).

Skipped only while the engine cannot be imported or started because of a missing module (the server is
being built in parallel); any other start-up failure fails the test.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from conveyor.bench.measure.prom_text import Snapshot
from conveyor.bench.measure.runner import BenchRunConfig, run_benchmark
from conveyor.bench.measure.summary import summary_to_json
from conveyor.bench.trace.trace_gen import AgentParams, ChatParams, LongParams, TraceMakeConfig, make_mixed_trace
from conveyor.bench.trace.traces import write_trace


def run_to_json(cfg: BenchRunConfig) -> dict[str, Any]:
    """One run; its summary as summary.json holds it (these tests assert on the file's keys)."""
    return summary_to_json(run_benchmark(cfg))

SRC = pathlib.Path(__file__).resolve().parents[3] / "src"
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    pytest.importorskip("conveyor.engine.core_client", reason="engine not built yet")
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    cmd = [sys.executable, "-m", "conveyor", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", "1024", "--max-num-seqs", "8",
           "--num-threads", "1"]  # the client and pytest share the cores: the CPU default would take them all
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(SRC)})
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, url, log)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()


def _wait_ready(proc: subprocess.Popen[bytes], url: str, log: pathlib.Path) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            text = log.read_text()
            if "ImportError" in text or "ModuleNotFoundError" in text:
                pytest.skip(f"conveyor serve cannot start yet: {text.strip().splitlines()[-1]}")
            raise AssertionError(f"conveyor serve exited with {proc.returncode}:\n{text[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"conveyor serve not ready after 120 s:\n{log.read_text()[-3000:]}")


def _small_mix(cancel_fraction: float, num_requests: int) -> TraceMakeConfig:
    return TraceMakeConfig(
        num_requests=num_requests, seed=3,
        chat=ChatParams(prompt_len_median=16, prompt_len_max=48, output_len_median=6, output_len_max=12),
        long=LongParams(prompt_len_min=120, prompt_len_max=200, output_len_min=4, output_len_max=8),
        agent=AgentParams(system_prompt_len=48, documents_len=96, question_len_min=4, question_len_max=8,
                          output_len_median=8, output_len_max=16, cancel_fraction=cancel_fraction,
                          cancel_after_s_max=0.3, cancel_after_tokens_max=3))


def _run(tmp: pathlib.Path, url: str, cfg: TraceMakeConfig, endpoint: str) -> dict:
    write_trace(make_mixed_trace(cfg), tmp / "trace.jsonl")
    return run_to_json(BenchRunConfig(base_url=url, trace_path=str(tmp / "trace.jsonl"), request_rate=20.0,
                                        out_dir=str(tmp / "run"), endpoint=endpoint, show_progress=False,
                                        request_timeout_s=120.0, scrape_interval_s=0.5))


def test_mixed_trace_accounted_and_tokens_match_server(server_url: str, tmp_path: pathlib.Path) -> None:
    s = _run(tmp_path, server_url, _small_mix(cancel_fraction=0.0, num_requests=10), "completions")
    assert s["num_prompts"] == 10 and s["completed"] == 10, s["errors_by_kind"]
    assert s["completed"] + s["cancelled"] + s["failed"] == s["num_prompts"]
    server = s["server"]
    assert server["available"]
    assert s["total_output_tokens"] == server["generation_tokens"]
    assert s["total_input_tokens"] == server["prompt_tokens"]
    assert server["queue_time_p95_ms"] is not None and server["num_preemptions"] is not None
    assert set(s["per_class"]) == {"chat", "long", "agent"}


def test_cancellations_on_chat_endpoint_are_accounted(server_url: str, tmp_path: pathlib.Path) -> None:
    cfg = _small_mix(cancel_fraction=1.0, num_requests=4)
    cfg = TraceMakeConfig(**{**cfg.__dict__, "mix": {"agent": 1.0}})
    s = _run(tmp_path, server_url, cfg, "chat")
    assert s["completed"] + s["cancelled"] + s["failed"] == s["num_prompts"] == 4
    assert s["failed"] == 0 and s["cancelled"] >= 1
    assert s["server"]["generation_tokens"] >= s["total_output_tokens"]


def test_peak_memory_and_identity_reach_the_summary(server_url: str, tmp_path: pathlib.Path) -> None:
    """conveyor:gpu_memory_peak_bytes (on CPU: the engine-core process's peak RSS) -> summary.json
    `server.peak_gpu_memory_bytes`; conveyor:model_info and conveyor:gpu_info -> `fixed`."""
    s = _run(tmp_path, server_url, _small_mix(cancel_fraction=0.0, num_requests=3), "completions")
    server = s["server"]
    assert server["gpu_memory_source"] in ("server", "nvml")
    if server["gpu_memory_source"] == "server":  # no NVML here: the engine's own peak, the weights at least
        assert server["peak_gpu_memory_bytes"] > 50 * 2**20
    fixed = s["fixed"]
    assert fixed["weights_sha256"] and len(fixed["weights_sha256"]) == 64
    with urllib.request.urlopen(f"{server_url}/metrics", timeout=10) as r:
        info = Snapshot.from_text(r.read().decode()).labels("conveyor:model_info")
    assert info is not None and info["weights_sha256"] == fixed["weights_sha256"]  # the server's = bench's own
    assert fixed["gpu_name"] is not None and fixed["server_name"] == "conveyor"
