"""The connection guards at scale, on a real `conveyor serve` process: 300 sockets against
`--limit-concurrency 200` (test_server_dropin.py checks the same guards with 14).

One flood, in the order that makes the outcome exact: 10 keep-alive connections that made one request,
60 that sent half a request head (slowloris), then 230 that send nothing. The server accepts in connect
order, so the first 200 are held and the last 100 must be answered 503 and closed at once -- well before
any timeout could have closed them. Every held socket must then be closed by the server, never before
its timeout (`--timeout-keep-alive` after the response for the keep-alive ones, `--header-timeout` from
connect for the others), and a real completion must be answered while the held sockets are still open
(once a few are let go: the cap counts every open connection) and after they are all gone. Dummy weights:
only the HTTP surface matters here, and they start faster.
"""

from __future__ import annotations

import http.client
import json
import re
import resource
import selectors
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx2 as httpx
import pytest
from serve_process import Server, running_server

pytestmark = pytest.mark.slow

CAP = 200
NUM_KEEP_ALIVE, NUM_PARTIAL, NUM_IDLE = 10, 60, 230
NUM_SOCKETS = NUM_KEEP_ALIVE + NUM_PARTIAL + NUM_IDLE
HEADER_TIMEOUT_S = 4.0  # long enough that a stall of the loaded machine cannot close a socket mid-flood
KEEP_ALIVE_S = 2.0
LATE_S = 10.0  # how late past its timeout a close may come on a loaded 2-core machine
SERVE_ARGS = ["--load-format", "dummy", "--max-model-len", "64", "--max-num-seqs", "4", "--kv-cache-memory", "64MiB",
              "--limit-concurrency", str(CAP), "--header-timeout", str(HEADER_TIMEOUT_S),
              "--timeout-keep-alive", str(KEEP_ALIVE_S)]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < NUM_SOCKETS + 100:
        pytest.skip(f"needs {NUM_SOCKETS + 100} file descriptors (ulimit -n is {soft})")
    with running_server(SERVE_ARGS) as server:
        yield server


@dataclass
class Held:
    """One client socket of the flood and what the server did with it."""

    sock: socket.socket
    opened_s: float
    """When its idle time began: connect, or the end of its response (keep-alive)."""
    timeout_s: float
    """After how long the server should close it, if it holds it."""
    conn: http.client.HTTPConnection | None = None
    """The keep-alive connection owning `sock` (kept so it is not collected and closed)."""
    data: bytes = b""
    """What the server sent on it (after the keep-alive response)."""
    closed_s: float | None = None
    """When it was closed (by the server, or by the test for `let_go`)."""
    reset: bool = False
    refused: bool = False
    let_go: bool = False


def address(server: Server) -> tuple[str, int]:
    match = re.match(r"http://([^:/]+):(\d+)", server.url)
    assert match
    return match.group(1), int(match.group(2))


def keep_alive_connection(server: Server) -> Held:
    """A connection that made one request (GET /ping) and keeps its socket open for the next."""
    host, port = address(server)
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request("GET", "/ping")
    response = conn.getresponse()
    response.read()
    assert response.status == 200 and conn.sock is not None
    return Held(conn.sock, time.monotonic(), KEEP_ALIVE_S, conn)


def flood(server: Server) -> list[Held]:
    held = [keep_alive_connection(server) for _ in range(NUM_KEEP_ALIVE)]
    for i in range(NUM_PARTIAL + NUM_IDLE):
        sock = socket.create_connection(address(server))
        if i < NUM_PARTIAL:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
        held.append(Held(sock, time.monotonic(), HEADER_TIMEOUT_S))
    return held


def watch(held: list[Held], until: float, enough: Callable[[], bool] = lambda: False) -> None:
    """Read every open socket until `until` (monotonic) or until `enough()`; record what came and closes."""
    selector = selectors.DefaultSelector()
    for entry in held:
        if entry.closed_s is None:
            selector.register(entry.sock, selectors.EVENT_READ, entry)
    try:
        while selector.get_map() and time.monotonic() < until and not enough():
            for key, _ in selector.select(timeout=max(0.0, min(0.5, until - time.monotonic()))):
                entry = key.data
                try:
                    chunk = entry.sock.recv(65536)
                except ConnectionResetError:
                    chunk, entry.reset = b"", True
                entry.data += chunk
                if not chunk:
                    entry.closed_s = time.monotonic()
                    selector.unregister(entry.sock)
    finally:
        selector.close()


def complete(server: Server) -> httpx.Response:
    body = {"model": server.model, "prompt": "Hi", "max_tokens": 2}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=60)


def refused_by_the_cap(held: list[Held]) -> list[Held]:
    """The fresh sockets the server closed before any of them could time out (marked `refused`)."""
    fresh = held[NUM_KEEP_ALIVE:]  # the keep-alive ones may be closed early: their timeout is shorter
    quiet_until = fresh[0].opened_s + HEADER_TIMEOUT_S - 0.5
    assert time.monotonic() < quiet_until - 1.0, "the flood itself took too long to tell refused from timed out"
    watch(held, quiet_until, enough=lambda: sum(e.closed_s is not None for e in fresh) >= NUM_SOCKETS - CAP)
    watch(held, min(quiet_until, time.monotonic() + 0.3))  # and no more than those
    refused = [e for e in fresh if e.closed_s is not None]
    for entry in refused:
        entry.refused = True
    return refused


def test_a_flood_past_the_cap_is_refused_at_once_and_idle_sockets_time_out(server: Server) -> None:
    before = len(server.log)
    held = flood(server)
    refused = refused_by_the_cap(held)
    num_refused = NUM_SOCKETS - CAP
    assert len(refused) == num_refused, f"{len(refused)} connections closed before any timeout, not {num_refused}"
    for entry in refused:
        assert entry.data.startswith(b"HTTP/1.1 503 "), entry.data[:200]
        assert json.loads(entry.data.split(b"\r\n\r\n", 1)[1])["error"]["code"] == 503
    assert all(e.data == b"" for e in held if not e.refused)  # the held sockets got nothing yet

    # during: every slot is taken, so let five idle ones go; a real completion then gets through while
    # the other 195 are still open
    for entry in [e for e in held if not e.refused][-5:]:
        entry.sock.close()
        entry.closed_s, entry.let_go = time.monotonic(), True
    answered = _answered_within(server, seconds=HEADER_TIMEOUT_S)
    assert answered.status_code == 200, answered.text
    first_timeout = held[NUM_KEEP_ALIVE].opened_s + HEADER_TIMEOUT_S
    assert time.monotonic() < first_timeout, "answered only after the held sockets timed out"

    watch(held, until=time.monotonic() + HEADER_TIMEOUT_S + LATE_S)
    for entry in held:
        if entry.refused or entry.let_go:
            continue
        assert entry.closed_s is not None, "a held socket was never closed by the server"
        idle_s = entry.closed_s - entry.opened_s
        assert idle_s >= entry.timeout_s - 0.05, f"closed after {idle_s:.2f} s, before its {entry.timeout_s} s timeout"
        assert entry.data == b"" and not entry.reset, entry.data[:200]
    assert complete(server).status_code == 200  # after: the server is whole
    for entry in held:
        entry.sock.close()
    log = "".join(server.log[before:])
    assert "Traceback" not in log
    assert log.count("refused a connection") == num_refused


def _answered_within(server: Server, seconds: float) -> httpx.Response:
    """The first answer that is not the cap's 503 (the server notices the five closes asynchronously)."""
    deadline = time.monotonic() + seconds
    while True:
        answer = complete(server)
        if answer.status_code != 503 or time.monotonic() > deadline:
            return answer
        time.sleep(0.05)
