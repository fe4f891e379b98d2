"""A real `conveyor serve` with one running slot and a 1 s queue timeout: a streamed request that times out
in the queue gets a real 503 (no 200 first), a 4 MB /tokenize does not stall a running stream, and a
kill -9 of the engine-core process ends every request with an error and the server non-zero (slow)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx2 as httpx
import pytest
from serve_process import Server, running_server, wait_idle

pytestmark = pytest.mark.slow

SERVE_ARGS = ["--max-model-len", "512", "--max-num-seqs", "1", "--queue-timeout", "1"]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with running_server(SERVE_ARGS) as server:
        yield server


class Stream:
    """A streaming completion read on a thread; `chunks` are arrival times of data events."""

    def __init__(self, url: str, max_tokens: int) -> None:
        self.chunks: list[float] = []
        self.events: list[str] = []
        self.status: int | None = None
        self.error: BaseException | None = None
        self._stop = threading.Event()
        body = {"prompt": "Write a long story", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        self._thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self._thread.start()

    def _run(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.chunks.append(time.monotonic())
                        self.events.append(line)
                    if self._stop.is_set():
                        return
        except httpx.TransportError as error:
            self.error = error

    def wait_chunks(self, count: int, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.chunks) < count:
            assert time.monotonic() < deadline and self._thread.is_alive(), (self.status, self.events)
            time.sleep(0.01)

    def close(self, timeout_s: float = 30) -> None:
        self._stop.set()
        self._thread.join(timeout=timeout_s)

    def join(self, timeout_s: float) -> None:
        """Read to the stream's end: `close` would stop at the next line, perhaps a token sent before an error."""
        self._thread.join(timeout=timeout_s)


def test_streamed_queue_timeout_is_a_real_503(server: Server) -> None:
    blocker = Stream(server.url, max_tokens=400)  # holds the only running slot
    blocker.wait_chunks(1)
    started = time.monotonic()
    body = {"prompt": "late", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 503, response.status_code
        assert response.headers["retry-after"] == "1"
        error = json.loads(response.read())["error"]
    assert error["type"] == "timeout_error" and "--queue-timeout=1.0" in error["message"]
    assert time.monotonic() - started >= 1.0
    blocker.close()
    metrics = wait_idle(server)
    assert metrics["conveyor:queue_timeouts_total"] >= 1


def test_4mb_tokenize_does_not_stall_a_running_stream(server: Server) -> None:
    stream = Stream(server.url, max_tokens=500)
    stream.wait_chunks(3)
    text = "word " * 800_000  # 4,000,000 characters: seconds of tokenization
    started = time.monotonic()
    reply = httpx.post(server.url + "/tokenize", json={"prompt": text}, timeout=300)
    ended = time.monotonic()
    assert reply.status_code == 200 and reply.json()["count"] >= 800_000
    chunks = list(stream.chunks)
    stream.close()
    window_end = ended if stream.events[-1] != "data: [DONE]" else min(ended, chunks[-1])
    during = [t for t in chunks if started <= t <= window_end]
    gaps = [b - a for a, b in zip([started, *during], [*during, window_end])]
    tokenize_s = ended - started
    print(f"tokenize {tokenize_s:.2f} s, {len(during)} chunks meanwhile, longest gap {max(gaps):.3f} s")
    assert tokenize_s > 1.0, "the prompt should take seconds to tokenize"
    # Tokenized on the event loop, the stream would stop for the whole call; off it, for about a step.
    assert len(during) >= 3 and max(gaps) < tokenize_s / 2, (tokenize_s, gaps)
    wait_idle(server)


def _engine_pid(server: Server) -> int:
    (pid,) = [p for p in server.children() if b"spawn_main" in open(f"/proc/{p}/cmdline", "rb").read()]
    return pid


def test_kill_9_of_the_engine_fails_every_request_and_the_server_exits_non_zero(server: Server) -> None:
    wait_idle(server)
    running = Stream(server.url, max_tokens=400)
    running.wait_chunks(2)
    waiting: list[int] = []
    thread = threading.Thread(target=lambda: waiting.append(
        httpx.post(server.url + "/v1/completions", json={"prompt": "w", "max_tokens": 4}, timeout=30).status_code))
    thread.start()
    time.sleep(0.3)  # queued behind the running one
    killed = time.monotonic()
    os.kill(_engine_pid(server), signal.SIGKILL)
    running.join(timeout_s=10)  # tokens already in flight come first; the 503 event ends the stream
    thread.join(timeout=10)
    assert time.monotonic() - killed < 5.0
    last = json.loads(running.events[-1][6:])
    assert "error" in last and last["error"]["code"] == 503, running.events[-3:]
    assert waiting == [503]
    assert server.proc.wait(timeout=10) not in (0, None)
    assert time.monotonic() - killed < 10.0
    assert "engine core is dead" in "".join(server.log)
