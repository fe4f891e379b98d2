"""`conveyor serve` as a drop-in for `vllm serve`, on a real server process with the embedded model.

Table-driven vLLM command lines (vLLM's own spellings: a positional model, `--max-model-len 4k`, `-O0`,
`--no-X`, ignored GPU flags): each starts, answers a request and exits 0 on SIGTERM. Then one server for
the module: structured outputs answered within the grammar (choice, regex, JSON schema), the vLLM
endpoints, the request surface (n, logit_bias, X-Request-Id, unknown fields), CORS, the API key on
/tokenize, 415, and the connection guards (header timeout, connection cap, a client that leaves mid-body).
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import time
from collections.abc import Iterator

import httpx2 as httpx
import pytest
from serve_process import Server, running_server, start_server

from conveyor.config import ModelConfig
from conveyor.engine.model_files import tokenizer_path

pytestmark = pytest.mark.slow

KEY = "k1"
AUTH = {"Authorization": f"Bearer {KEY}"}
SMALL = ["--kv-cache-memory", "384MiB"]  # holds the GGUF's 8192 positions (`--max-model-len auto`)


def model() -> str:
    return str(tokenizer_path(ModelConfig()))  # the embedded GGUF, passed as vLLM's positional MODEL


COMMAND_LINES = [
    "{model}",
    "{model} --dtype auto --api-key token-abc123",
    "{model} --max-model-len 4k --tensor-parallel-size 1 --trust-remote-code --gpu-memory-utilization 0.5",
    "{model} --served-model-name smol --dtype float --max-model-len auto -O0 --no-enable-prefix-caching "
    "--uvicorn-log-level warning --disable-log-stats --enable-log-requests",
    "--model {model} --max-num-seqs 4 --max_num_batched_tokens 512 --swap-space 0 --disable-uvicorn-access-log",
]


@pytest.mark.parametrize("line", COMMAND_LINES)
def test_vllm_command_line_starts_answers_and_exits_cleanly(line: str) -> None:
    args = line.format(model=model()).split() + SMALL
    server = start_server(args)
    try:
        headers = {"Authorization": "Bearer token-abc123"} if "--api-key" in args else {}
        body = {"model": server.model, "prompt": "Hello", "max_tokens": 3}
        response = httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 3
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0, "".join(server.log[-20:])
        assert "Traceback" not in "".join(server.log)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    args = [model(), "--served-model-name", "smol", "--api-key", KEY, "--allowed-origins", '["http://a.example"]',
            "--header-timeout", "2", "--limit-concurrency", "12", "--max-model-len", "1024", *SMALL]
    with running_server(args) as server:
        yield server


def post(server: Server, path: str, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={**AUTH, **headers}, timeout=120)


def chat(content: str, **fields: object) -> dict:
    return {"model": "smol", "messages": [{"role": "user", "content": content}], "max_tokens": 40, **fields}


def test_structured_choice_regex_and_legacy_fields(server: Server) -> None:
    for field in ({"structured_outputs": {"choice": ["yes", "no"]}}, {"guided_choice": ["yes", "no"]}):
        answer = post(server, "/v1/chat/completions", chat("Is the sky blue?", **field)).json()
        assert answer["choices"][0]["message"]["content"] in ("yes", "no"), answer
    for field in ({"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}}, {"guided_regex": "[0-9]{3}-[0-9]{4}"}):
        body = {"model": "smol", "prompt": "My phone number is", "max_tokens": 12, **field}
        text = post(server, "/v1/completions", body).json()["choices"][0]["text"]
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", text), text


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def test_structured_json_parses_and_follows_the_schema(server: Server) -> None:
    formats = [{"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}},
               {"structured_outputs": {"json": SCHEMA}}]
    for field in formats:
        answer = post(server, "/v1/chat/completions", chat("Describe a person as JSON.", max_tokens=80, **field))
        value = json.loads(answer.json()["choices"][0]["message"]["content"])
        assert set(value) == {"name", "age"} and isinstance(value["age"], int)
        assert isinstance(value["name"], str) and len(value["name"]) <= 12
    # json_object is any JSON: the grammar fixes the syntax, not the length, so a run cut by max_tokens is
    # a JSON prefix; one that ended by itself parses
    answer = post(server, "/v1/chat/completions", chat("Reply with {}.", max_tokens=200,
                                                       response_format={"type": "json_object"})).json()["choices"][0]
    text = answer["message"]["content"]
    assert text.lstrip()[:1] in ("{", "[")
    if answer["finish_reason"] == "stop":
        assert isinstance(json.loads(text), (dict, list))


LOOP = {"$ref": "#/definitions/a", "definitions": {"a": {"$ref": "#/definitions/a"}}}


def test_an_output_that_cannot_follow_its_grammar_is_an_error_never_a_stop(server: Server) -> None:
    """Issue 34's cases: each was a 200 "stop" with text outside the grammar ("aaaa", "", "")."""
    for field, name in (({"guided_regex": "a{1000000}"}, "guided_regex"), ({"guided_json": LOOP}, "guided_json"),
                        ({"structured_outputs": {"json": LOOP}}, "structured_outputs.json")):
        for stream in (False, True):
            body = {"model": "smol", "prompt": "hi", "max_tokens": 8, "stream": stream, **field}
            answer = post(server, "/v1/completions", body)
            if answer.status_code == 200:  # a stream whose first token went out before the grammar failed
                assert stream and "[DONE]" not in answer.text and '"finish_reason":"stop"' not in answer.text
                error = json.loads(answer.text.strip().split("\n\n")[-1].removeprefix("data: "))["error"]
            else:
                assert answer.status_code == 400, answer.text
                error = answer.json()["error"]
            assert error["param"] == name and "can no longer follow the grammar" in error["message"]
    choices = [f"c{i}x" for i in range(100_000)]  # one regex: checked in about a second, then served
    answer = post(server, "/v1/completions", {"model": "smol", "prompt": "pick", "max_tokens": 12,
                                              "guided_choice": choices})
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] in set(choices)
    assert answer.json()["choices"][0]["finish_reason"] == "stop"


def test_streams_and_health_go_on_while_a_huge_choice_compiles(server: Server) -> None:
    """Issue 34's proof: the grammar was compiled on the API server's event loop (6 s for 100,000
    choices, every stream and /health frozen) and its matcher built inside an engine step. With 100,000
    choices in flight a concurrent stream's largest gap and /health stay under a (generous) second."""
    choices = [f"c{i}x" for i in range(100_000)]

    async def main() -> tuple[list[float], list[float], httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=300) as client:
            body = {"model": "smol", "prompt": "Count", "max_tokens": 1000, "ignore_eos": True, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as stream:
                chunks = stream.aiter_lines()
                await chunks.__anext__()  # the stream runs
                big = asyncio.ensure_future(client.post("/v1/completions", json={
                    "model": "smol", "prompt": "pick", "max_tokens": 12, "guided_choice": choices}))
                gaps, health = [], []
                last = time.monotonic()
                async for _ in chunks:
                    gaps.append(time.monotonic() - last)
                    if big.done():
                        break
                    if len(gaps) % 20 == 0:
                        start = time.monotonic()
                        assert (await client.get("/health")).status_code == 200
                        health.append(time.monotonic() - start)
                    last = time.monotonic()
                answer = await big
            return gaps, health, answer

    gaps, health, answer = asyncio.run(main())
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] in set(choices), answer.text
    assert len(gaps) > 20, gaps  # the stream went on during the compile
    assert max(gaps) < 1.0 and max(health, default=0) < 1.0, (sorted(gaps)[-5:], health)


def test_vllm_endpoints(server: Server) -> None:
    base = server.url
    assert httpx.get(base + "/ping", timeout=10).status_code == 200
    invoked = post(server, "/invocations", {"prompt": "Hi", "max_tokens": 2})
    assert invoked.status_code == 200 and invoked.json()["object"] == "text_completion"
    assert post(server, "/invocations", chat("Hi", max_tokens=2)).json()["object"] == "chat.completion"
    assert httpx.get(base + "/load", headers=AUTH, timeout=10).json() == {"server_load": 0}
    reset = post(server, "/reset_prefix_cache", {})
    assert reset.status_code == 200


def test_request_surface(server: Server) -> None:
    answer = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "n": 2, "logit_bias": {"13": 5}},
                  **{"X-Request-Id": "req-77"})
    assert answer.status_code == 200 and answer.headers["x-request-id"] == "req-77"
    assert [c["index"] for c in answer.json()["choices"]] == [0, 1]
    usage = answer.json()["usage"]
    assert usage["prompt_tokens"] == 1 and usage["completion_tokens"] == 6  # the prompt counted once
    unknown = post(server, "/v1/completions", {"prompt": "Hi", "bogus_field": 1})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "bogus_field"


def test_cors_key_and_content_type(server: Server) -> None:
    base = server.url
    preflight = {"Access-Control-Request-Method": "POST"}
    allowed = httpx.options(base + "/v1/completions", headers={"Origin": "http://a.example", **preflight}, timeout=10)
    assert allowed.headers["access-control-allow-origin"] == "http://a.example"
    other = httpx.options(base + "/v1/completions", headers={"Origin": "http://evil.example", **preflight}, timeout=10)
    assert "access-control-allow-origin" not in other.headers
    assert httpx.post(base + "/tokenize", json={"prompt": "x"}, timeout=10).status_code == 401
    assert post(server, "/tokenize", {"prompt": "x"}).status_code == 200
    plain = httpx.post(base + "/v1/completions", content=b'{"prompt": "x"}', timeout=10,
                       headers={**AUTH, "Content-Type": "text/plain"})
    assert plain.status_code == 415


def host_port(server: Server) -> tuple[str, int]:
    match = re.match(r"http://([^:/]+):(\d+)", server.url)
    assert match
    return match.group(1), int(match.group(2))


def closed_by_server(sock: socket.socket, timeout_s: float) -> bool:
    sock.settimeout(timeout_s)
    try:
        return sock.recv(4096) == b""
    except (TimeoutError, socket.timeout):
        return False
    except ConnectionResetError:
        return True


def test_idle_and_header_only_connections_are_closed_and_capped(server: Server) -> None:
    address = host_port(server)
    idle = [socket.create_connection(address) for _ in range(5)]
    partial = [socket.create_connection(address) for _ in range(5)]
    for sock in partial:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # a head that never ends (slowloris)
    extra = [socket.create_connection(address) for _ in range(4)]  # 14 open > --limit-concurrency 12
    refused = [sock for sock in extra if b"503" in _read_some(sock)]
    assert refused, "no connection beyond --limit-concurrency was refused"
    deadline = time.monotonic() + 15
    for sock in idle + partial:  # --header-timeout 2
        assert closed_by_server(sock, max(0.1, deadline - time.monotonic()))
    for sock in idle + partial + extra:
        sock.close()
    assert post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 1}).status_code == 200


def _read_some(sock: socket.socket) -> bytes:
    sock.settimeout(3)
    try:
        return sock.recv(4096)
    except (TimeoutError, socket.timeout):
        return b""


def test_a_client_leaving_mid_body_logs_no_traceback(server: Server) -> None:
    before = len(server.log)
    sock = socket.create_connection(host_port(server))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k1\r\n"
                 b"Content-Type: application/json\r\nContent-Length: 200\r\n\r\n{\"prompt\": ")
    time.sleep(0.3)
    sock.close()
    time.sleep(1.0)
    assert post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 1}).status_code == 200
    assert "Traceback" not in "".join(server.log[before:])


HOSTILE = [  # (path, raw body, status, the field the error names): the four 500s and sampling extremes
    ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', 400, "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}', 400,
     "messages"),
    ("/tokenize", b'{"prompt": "\\ud800"}', 400, "prompt"),
    ("/tokenize", b'{"messages": []}', 400, "messages"),
    ("/v1/completions", b'{"prompt": "x", "temperature": 1e400}', 400, "temperature"),
]


@pytest.mark.parametrize(("path", "raw", "status", "param"), HOSTILE)
def test_hostile_inputs_on_the_real_tokenizer(server: Server, path: str, raw: bytes, status: int, param: str) -> None:
    answer = httpx.post(server.url + path, content=raw, headers={**AUTH, "Content-Type": "application/json"},
                        timeout=60)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["param"] is not None and error["param"].startswith(param)
    assert "Traceback" not in answer.text and "TypeError" not in answer.text
    assert post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 1}).status_code == 200


def test_tiny_repetition_penalty_still_generates_text(server: Server) -> None:
    answer = post(server, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 8, "ignore_eos": True,
                                              "repetition_penalty": 1e-300}).json()
    assert answer["usage"]["completion_tokens"] == 8 and answer["choices"][0]["text"] != ""
