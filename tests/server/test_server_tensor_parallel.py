"""`conveyor serve --tensor-parallel-size 2` on the embedded model (CPU, gloo): it answers like one rank, and
a kill -9 of rank 1 mid-stream ends the stream with an error, fails the waiting request and takes the
server down with a non-zero exit, in seconds; SIGTERM drains, stops the ranks and exits 0 (slow)."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import threading
import time

import httpx2 as httpx
import pytest
from serve_process import Server, running_server, wait_idle

pytestmark = pytest.mark.slow

BODY = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
ONE_RANK_TEXT = " Paris.\n\nThe answer is:"
"""What `conveyor serve --quantization none` (one rank) answers to BODY."""


def _children_of(pid: int) -> list[int]:
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if int(fields[1]) == pid and b"spawn_main" in cmdline:
                found.append(int(entry.name))
    return found


def _rank_pid(server: Server) -> int:
    (engine,) = [p for p in server.children() if b"spawn_main" in open(f"/proc/{p}/cmdline", "rb").read()]
    (rank,) = _children_of(engine)
    return rank


def test_two_ranks_serve_and_a_killed_rank_takes_the_server_down() -> None:
    with running_server(["--tensor-parallel-size", "2", "--quantization", "none", "--max-model-len", "512",
                         "--max-num-seqs", "1"]) as server:
        reply = httpx.post(server.url + "/v1/completions", json=BODY, timeout=60).json()
        assert reply["choices"][0]["text"] == ONE_RANK_TEXT
        events: list[str] = []
        stream_body = {"prompt": "Tell a story", "max_tokens": 400, "ignore_eos": True, "stream": True}

        def stream() -> None:
            with httpx.stream("POST", server.url + "/v1/completions", json=stream_body, timeout=60) as response:
                events.extend(line for line in response.iter_lines() if line.startswith("data: "))

        reader = threading.Thread(target=stream)
        reader.start()
        while len(events) < 3:
            assert reader.is_alive(), events
            time.sleep(0.01)
        waiting: list[int] = []  # queued behind the stream (one running slot)
        queued = threading.Thread(target=lambda: waiting.append(
            httpx.post(server.url + "/v1/completions", json=BODY, timeout=30).status_code))
        queued.start()
        time.sleep(0.3)
        killed = time.monotonic()
        os.kill(_rank_pid(server), signal.SIGKILL)
        reader.join(timeout=15)
        queued.join(timeout=15)
        last = json.loads(events[-1][6:])
        assert "error" in last and last["error"]["code"] == 503, events[-3:]
        assert waiting == [503]
        assert server.proc.wait(timeout=15) not in (0, None)
        assert time.monotonic() - killed < 15.0
        assert "tensor-parallel rank 1" in "".join(server.log) and "killed by signal 9" in "".join(server.log)


def test_sigterm_stops_the_ranks_and_exits_zero() -> None:
    with running_server(["--tensor-parallel-size", "2", "--quantization", "none", "--max-model-len", "512"]) as server:
        rank = _rank_pid(server)
        replies = [httpx.post(server.url + "/v1/completions", json=BODY, timeout=60) for _ in range(2)]
        assert [r.json()["choices"][0]["text"] for r in replies] == [ONE_RANK_TEXT] * 2
        assert wait_idle(server)["vllm:kv_cache_usage_perc"] == 0  # every block back in the pool
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=30) == 0, "".join(server.log)[-3000:]
        deadline = time.monotonic() + 10
        while pathlib.Path(f"/proc/{rank}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pathlib.Path(f"/proc/{rank}").exists(), "rank 1 outlived the server"
        assert "tensor-parallel rank" not in "".join(server.log)  # no rank failure reported on the way down
