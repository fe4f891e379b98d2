"""A body that never arrives whole is a 408 after --body-timeout: it cannot hold its connection forever."""

from __future__ import annotations

import socket
import time
import urllib.parse

import httpx2 as httpx
import pytest
from server_helpers import live_server

HEAD = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n")
BODY = b'{"prompt": "hi", "max_tokens": 2}'


def _connect(url: str) -> socket.socket:
    parts = urllib.parse.urlsplit(url)
    return socket.create_connection((parts.hostname, parts.port), timeout=10)


def _answer(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


@pytest.mark.parametrize("mode", ["short", "trickle"])
def test_a_body_that_does_not_arrive_is_a_408(mode: str) -> None:
    with live_server(body_timeout_s=1.0) as server:
        sock = _connect(server.url)
        start = time.monotonic()
        if mode == "short":  # a body shorter than its Content-Length, then silence
            sock.sendall(HEAD % (len(BODY) + 10) + BODY)
        else:  # a byte every 0.3 s: each byte would restart a per-read timer, the deadline is for the whole body
            sock.sendall(HEAD % len(BODY))
            for byte in BODY[:6]:
                sock.sendall(bytes([byte]))
                time.sleep(0.3)
        answer = _answer(sock)
        elapsed = time.monotonic() - start
        sock.close()
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert elapsed < 8.0
        ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        assert ok.status_code == 200  # the server keeps serving


def test_the_timeout_is_validated() -> None:
    from conveyor.config import ConfigError
    from conveyor.server.server_config import ServerConfig

    with pytest.raises(ConfigError, match="body_timeout_s"):
        ServerConfig(body_timeout_s=0)
