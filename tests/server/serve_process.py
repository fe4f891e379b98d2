"""A real `conveyor serve` subprocess (engine-core process + API server(s)) for end-to-end tests."""

from __future__ import annotations

import os
import pathlib
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx2 as httpx
from prometheus_client.parser import text_string_to_metric_families

SRC = pathlib.Path(__file__).resolve().parents[2] / "src"
URL_LINE = re.compile(r"serving (\S+) at (http://\S+)/v1")
STARTUP_TIMEOUT_S = 240


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    model: str
    log: list[str]

    def children(self) -> list[int]:
        """Pids of the processes `conveyor serve` started (engine core, API servers)."""
        found = []
        for entry in pathlib.Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(fields[1]) == self.proc.pid:
                    cmdline = (entry / "cmdline").read_bytes()
                    if b"resource_tracker" not in cmdline:
                        found.append(int(entry.name))
        return sorted(found)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@contextmanager
def running_server(args: list[str]) -> Iterator[Server]:
    """`start_server`, killed afterwards if a test has not stopped it (for module-scoped fixtures)."""
    server = start_server(args)
    try:
        yield server
    finally:
        server.stop()


async def stream_status(client: httpx.AsyncClient, i: int, statuses: list[tuple[int, dict]]) -> None:
    """One long streaming completion of a burst: its status and headers go to `statuses`."""
    body = {"prompt": f"Count to {i}", "max_tokens": 200, "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        statuses.append((response.status_code, dict(response.headers)))
        await response.aread()


def _pump(proc: subprocess.Popen, lines: queue.Queue, log: list[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        log.append(line)
        lines.put(line)
    lines.put(None)


def start_server(args: list[str]) -> Server:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    # One engine thread unless a test says otherwise: pytest and the test's clients share the CI box's
    # cores with the server, and the CPU default (every core on 2 cores) would make its OpenMP threads
    # wait on those processes (docs/serving.md, CPU cores).
    pinned = [] if "--num-threads" in args else ["--num-threads", "1"]
    proc = subprocess.Popen([sys.executable, "-m", "conveyor", "serve", "--port", "0", "--seed", "0", *pinned, *args],
                            env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines: queue.Queue = queue.Queue()
    log: list[str] = []
    threading.Thread(target=_pump, args=(proc, lines, log), daemon=True).start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        assert line is not None, "server exited during start-up:\n" + "".join(log)
        if match := URL_LINE.search(line):
            return Server(proc, match.group(2), match.group(1), log)


def scrape(server: Server) -> dict[str, float]:
    """`name{label=value,...}` (labels other than model_name and engine, if any) -> value."""
    values: dict[str, float] = {}
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "engine"))
            values[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return values


def wait_idle(server: Server, timeout_s: float = 30) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = scrape(server)
        if metrics.get("vllm:num_requests_running", 0) == 0 and metrics.get("vllm:num_requests_waiting", 0) == 0 \
                and metrics.get("vllm:kv_cache_usage_perc", 0) == 0:
            return metrics
        assert time.monotonic() < deadline, f"server did not go idle: {metrics}"
        time.sleep(0.1)
