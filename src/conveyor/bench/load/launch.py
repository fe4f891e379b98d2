"""Start, health-check, warm up and stop one server per configuration, from a command template.

The model: a `ServerSpec` holds a command template such as
`conveyor serve --port {port} {args}` or `vllm serve meta-llama/Llama-3.1-8B --port {port} {args}`;
`{port}` and `{host}` are filled in, and `{args}` receives the configuration's engine flags rendered
with vLLM's spelling (`max_num_seqs=8` -> `--max-num-seqs 8`, `enable_chunked_prefill=False` ->
`--no-enable-chunked-prefill`, a table such as `speculative_config` -> its JSON). The server runs in
its own process group with stdout+stderr in `server.log`, and its exact argv in `command.txt`, both in
the configuration's directory. Readiness is
GET `health_path` returning 200 before `startup_timeout_s`; a server that exits early fails at once with
the tail of its log. Warm-up sends a few short completions so the first measured requests do not pay
for lazy initialisation. Stop is SIGTERM to the group, then SIGKILL after `stop_grace_s`.
Stdlib only (urllib), so launching never needs the benchmark's async client.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class LaunchError(RuntimeError):
    """The server did not start or did not become healthy; carries the tail of its log."""


@dataclass(frozen=True)
class ServerSpec:
    """How to start one server configuration."""

    name: str
    """Configuration name (directory name of its runs)."""
    command: str
    """Command template with {port}, {host} and {args} placeholders."""
    args: dict[str, Any] = field(default_factory=dict)
    """Engine flags of this configuration, rendered into {args}."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for the server process."""
    host: str = "127.0.0.1"
    """Address the server binds and the benchmark connects to."""
    port: int = 0
    """Port (0: pick a free one at launch)."""
    health_path: str = "/health"
    """GET path that returns 200 once the server is ready."""
    startup_timeout_s: float = 300.0
    """How long to wait for health."""
    stop_grace_s: float = 15.0
    """SIGTERM-to-SIGKILL grace."""
    num_warmup_requests: int = 2
    """Short completions sent before measuring (0: none)."""
    model: str | None = None
    """`model` field of warm-up requests (None: the first id in /v1/models)."""


def render_args(args: dict[str, Any]) -> list[str]:
    """{max_num_seqs: 8, enable_chunked_prefill: False} -> ['--max-num-seqs', '8', '--no-enable-chunked-prefill']."""
    out: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is None:
            continue
        if value is True:
            out.append(flag)
        elif value is False:
            out.append("--no-" + key.replace("_", "-"))
        elif isinstance(value, (dict, list)):  # e.g. speculative_config: vLLM's flags take JSON
            out.extend([flag, json.dumps(value, separators=(",", ":"))])
        else:
            out.extend([flag, str(value)])
    return out


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def render_command(spec: ServerSpec, port: int) -> list[str]:
    rendered = spec.command.replace("{args}", shlex.join(render_args(spec.args)))
    rendered = rendered.replace("{port}", str(port)).replace("{host}", spec.host)
    return shlex.split(rendered)


def _http_json(url: str, body: dict[str, Any] | None = None, timeout_s: float = 5.0) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        text = response.read().decode() or "null"
        try:
            return response.status, json.loads(text)
        except json.JSONDecodeError:
            return response.status, text


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class ServerProcess:
    """A running server; use as a context manager so it is always stopped."""

    def __init__(self, spec: ServerSpec, out_dir: Path, progress: Callable[[str], None] | None = None) -> None:
        self.spec, self.out_dir = spec, out_dir
        self.progress = progress or _to_stderr  # stdout is kept for the report
        self.port = spec.port or free_port(spec.host)
        self.argv = render_command(spec, self.port)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.spec.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.out_dir / "server.log"

    def start(self) -> ServerProcess:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "command.txt").write_text(shlex.join(self.argv) + "\n")
        env = {**os.environ, **self.spec.env}
        self.progress(f"[launch {self.spec.name}] {shlex.join(self.argv)}")
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
        try:
            self.wait_healthy()
            self.warm_up()
        except BaseException:
            self.stop()
            raise
        return self

    def log_tail(self, num_chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:] if self.log_path.is_file() else ""

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.spec.startup_timeout_s
        started = time.monotonic()
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise LaunchError(f"server {self.spec.name} exited with {self.process.returncode} before "
                                  f"becoming healthy; log tail:\n{self.log_tail()}")
            try:
                status, _ = _http_json(self.base_url + self.spec.health_path, timeout_s=2.0)
                if status == 200:
                    self.progress(f"[launch {self.spec.name}] healthy after {time.monotonic() - started:.1f} s "
                                  f"on {self.base_url}")
                    return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        raise LaunchError(f"server {self.spec.name} not healthy after {self.spec.startup_timeout_s:.0f} s "
                          f"(--startup-timeout); log tail:\n{self.log_tail()}")

    def served_model(self) -> str | None:
        if self.spec.model is not None:
            return self.spec.model
        try:
            _, models = _http_json(self.base_url + "/v1/models")
            return str(models["data"][0]["id"])
        except (urllib.error.URLError, OSError, KeyError, IndexError, TypeError):
            return None

    def warm_up(self) -> None:
        if self.spec.num_warmup_requests < 1:
            return
        body: dict[str, Any] = {"prompt": "Hello, warm-up.", "max_tokens": 4, "temperature": 0.0}
        model = self.served_model()
        if model is not None:
            body["model"] = model
        for _ in range(self.spec.num_warmup_requests):
            try:
                _http_json(self.base_url + "/v1/completions", body, timeout_s=120.0)
            except (urllib.error.URLError, OSError) as error:
                raise LaunchError(f"warm-up request to {self.spec.name} failed: {error}; log tail:\n"
                                  f"{self.log_tail()}") from None
        self.progress(f"[launch {self.spec.name}] warmed up with {self.spec.num_warmup_requests} requests")

    def stop(self) -> int | None:
        """SIGTERM the server's process group, SIGKILL after the grace; returns its exit status."""
        process = self.process
        if process is None or process.poll() is not None:
            return None if process is None else process.returncode
        os.killpg(process.pid, signal.SIGTERM)
        try:
            return process.wait(timeout=self.spec.stop_grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            return process.wait()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        code = self.stop()
        self.progress(f"[launch {self.spec.name}] stopped (exit {code})")
