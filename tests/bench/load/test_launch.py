"""Launching a server from a command template, against a tiny stand-in HTTP server."""

from __future__ import annotations

import pathlib
import sys

import pytest

from conveyor.bench.load.launch import LaunchError, ServerProcess, ServerSpec, render_args, render_command

FAKE_SERVER = r'''
import json, sys, signal
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def _send(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        self._send({"data": [{"id": "fake"}]} if self.path == "/v1/models" else {})
    def do_POST(self):
        n = int(self.headers["Content-Length"]); print("POST", json.loads(self.rfile.read(n)), flush=True)
        self._send({"choices": [{"text": "hi"}]})
print("args", sys.argv[1:], flush=True)
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
'''


def test_render_args_uses_vllm_spelling() -> None:
    args = {"max_num_seqs": 8, "enable_chunked_prefill": False, "enforce_eager": True, "queue_timeout": None}
    assert render_args(args) == ["--max-num-seqs", "8", "--no-enable-chunked-prefill", "--enforce-eager"]
    spec = ServerSpec("a", "vllm serve m --port {port} --host {host} {args}", args={"batching": "static"})
    assert render_command(spec, 1234) == ["vllm", "serve", "m", "--port", "1234", "--host", "127.0.0.1",
                                          "--batching", "static"]


def test_start_health_warmup_stop(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    spec = ServerSpec("fake", f"{sys.executable} {script} {{port}} {{args}}", args={"max_num_seqs": 4},
                      startup_timeout_s=20, stop_grace_s=5)
    with ServerProcess(spec, tmp_path / "fake", progress=lambda _: None) as server:
        assert server.base_url.startswith("http://127.0.0.1:")
    log = (tmp_path / "fake" / "server.log").read_text()
    assert "'--max-num-seqs', '4'" in log and log.count("POST {") == 2 and "'model': 'fake'" in log
    assert str(script) in (tmp_path / "fake" / "command.txt").read_text()
    assert server.process is not None and server.process.returncode == 0


def test_early_exit_reports_log(tmp_path: pathlib.Path) -> None:
    spec = ServerSpec("dead", f"{sys.executable} -c \"print('boom: bad flag'); raise SystemExit(3)\"",
                      startup_timeout_s=20)
    with pytest.raises(LaunchError, match="boom: bad flag"):
        ServerProcess(spec, tmp_path / "dead", progress=lambda _: None).start()
