"""SIGTERM on a server process (fake engine, real `serve` + DrainingServer): drain, then exit 0."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import httpx2 as httpx
import pytest
from server_helpers import free_port

pytestmark = pytest.mark.slow  # starts real servers

HERE = pathlib.Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
SERVER_CODE = """
import asyncio, sys
from fake_engine import FakeEngine, FakeEngineConfig
from conveyor.server.server_config import ServerConfig
from conveyor.server.front_end import serve
engine = FakeEngine(FakeEngineConfig(token_delay_s=float(sys.argv[3])))
asyncio.run(serve(engine, ServerConfig(port=int(sys.argv[1]), shutdown_grace_s=float(sys.argv[2]))))
print("engine shut down:", engine.shut_down, "aborted:", len(engine.state.aborted))
"""


def start(grace_s: float, token_delay_s: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{HERE}"}
    proc = subprocess.Popen([sys.executable, "-c", SERVER_CODE, str(port), str(grace_s), str(token_delay_s)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while True:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.05)


def test_sigterm_drains_in_flight_refuses_new_and_exits_0() -> None:
    proc, url = start(grace_s=10, token_delay_s=0.02)
    try:
        with httpx.Client(base_url=url, timeout=10) as client:
            with client.stream("POST", "/v1/completions",
                               json={"prompt": "x", "max_tokens": 40, "stream": True}) as stream:
                lines = stream.iter_lines()
                assert next(lines).startswith("data: ")
                proc.send_signal(signal.SIGTERM)
                time.sleep(0.2)
                with httpx.Client(base_url=url, timeout=5) as late:
                    refused = late.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
                    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
                    assert late.get("/health").status_code == 503
                rest = [line for line in lines if line.startswith("data: ")]
                assert rest[-1] == "data: [DONE]" and len(rest) == 40  # 39 more tokens + [DONE]
        output, _ = proc.communicate(timeout=15)
        assert proc.returncode == 0, output
        assert "engine shut down: True aborted: 0" in output
    finally:
        proc.kill()


def test_grace_expiry_aborts_streams_cleanly_and_still_exits_0() -> None:
    """When the grace runs out, a stream still in flight ends with finish_reason "abort" and [DONE]."""
    proc, url = start(grace_s=0.3, token_delay_s=0.1)  # the stream would need 12 s
    try:
        with httpx.Client(base_url=url, timeout=10) as client:
            with client.stream("POST", "/v1/completions",
                               json={"prompt": "x", "max_tokens": 120, "stream": True}) as stream:
                lines = stream.iter_lines()
                next(lines)
                started = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][len("data: "):])["choices"][0]["finish_reason"] == "abort"
        output, _ = proc.communicate(timeout=15)
        assert proc.returncode == 0, output
        assert time.monotonic() - started < 1.5 + 2.0  # grace + uvicorn's own shutdown timeout
        assert "grace period over" in output and "aborted: 1" in output
    finally:
        proc.kill()
