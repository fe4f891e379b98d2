"""A real `conveyor serve` process on the embedded model, driven by real clients (slow: loads the model).

One server for the module (small limits so overload is easy to reach): the official `openai` client,
32 concurrent streams whose token counts agree with /metrics, 20 clients that leave mid-stream,
overload 503s, and finally SIGTERM -> exit 0.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx2 as httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

SRC = pathlib.Path(__file__).resolve().parents[2] / "src"
MAX_NUM_SEQS = 8
MAX_NUM_QUEUED = 32
SERVE_ARGS = ["--port", "0", "--max-model-len", "512", "--max-num-seqs", str(MAX_NUM_SEQS),
              "--max-num-queued-reqs", str(MAX_NUM_QUEUED), "--shutdown-grace", "20", "--seed", "0"]
URL_LINE = re.compile(r"serving (\S+) at (http://\S+)/v1")


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    model: str
    log: list[str]


def _pump(proc: subprocess.Popen, lines: queue.Queue, log: list[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        log.append(line)
        lines.put(line)
    lines.put(None)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.Popen([sys.executable, "-m", "conveyor", "serve", *SERVE_ARGS], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines: queue.Queue = queue.Queue()
    log: list[str] = []
    threading.Thread(target=_pump, args=(proc, lines, log), daemon=True).start()
    deadline = time.monotonic() + 240
    while True:
        line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        assert line is not None, "server exited during start-up:\n" + "".join(log)
        if match := URL_LINE.search(line):
            break
    try:
        yield Server(proc, match.group(2), match.group(1), log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def scrape(server: Server) -> dict[str, float]:
    """`name{label=value,...}` (labels other than model_name, if any) -> value."""
    values: dict[str, float] = {}
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            values[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return values


def wait_idle(server: Server, timeout_s: float = 30) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = scrape(server)
        if metrics["vllm:num_requests_running"] == 0 and metrics["vllm:num_requests_waiting"] == 0 \
                and metrics["vllm:kv_cache_usage_perc"] == 0:
            return metrics
        assert time.monotonic() < deadline, f"server did not go idle: {metrics}"
        time.sleep(0.1)


def test_openai_client_completions_and_chat(server: Server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [server.model]
    completion = client.completions.create(model=server.model, prompt="The capital of France is",
                                           max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 6 and completion.choices[0].finish_reason == "length"
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 6
    pieces, usage = [], None
    for chunk in client.completions.create(model=server.model, prompt="The capital of France is", max_tokens=6,
                                           temperature=0, stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True}):
        pieces += [c.text for c in chunk.choices]
        usage = chunk.usage or usage
    assert "".join(pieces) == completion.choices[0].text  # greedy: same text streamed or not
    assert usage is not None and usage.completion_tokens == 6
    messages = [{"role": "user", "content": "Say hello."}]
    chat = client.chat.completions.create(model=server.model, messages=messages, max_completion_tokens=5,
                                          temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 5
    deltas, usage = [], None
    for chunk in client.chat.completions.create(model=server.model, messages=messages, max_tokens=5,
                                                temperature=0, stream=True, stream_options={"include_usage": True}):
        deltas += [c.delta.content or "" for c in chunk.choices]
        usage = chunk.usage or usage
    assert "".join(deltas) == chat.choices[0].message.content
    assert usage is not None and usage.completion_tokens == chat.usage.completion_tokens


async def _stream_count(client: openai.AsyncOpenAI, model: str, i: int, max_tokens: int) -> tuple[int, str]:
    stream = await client.completions.create(model=model, prompt=f"Story number {i}:", max_tokens=max_tokens,
                                             temperature=0.8, seed=i, stream=True,
                                             stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    usage, finish = None, None
    async for chunk in stream:
        finish = next((c.finish_reason for c in chunk.choices if c.finish_reason), finish)
        usage = chunk.usage or usage
    assert usage is not None
    return usage.completion_tokens, finish


def test_32_concurrent_streams_agree_with_metrics(server: Server) -> None:
    before = wait_idle(server)

    async def main() -> list[tuple[int, str]]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
            return await asyncio.gather(*(_stream_count(client, server.model, i, 4 + i % 5) for i in range(32)))

    results = asyncio.run(main())
    assert [n for n, _ in results] == [4 + i % 5 for i in range(32)]
    assert {finish for _, finish in results} == {"length"}
    after = wait_idle(server)
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == sum(n for n, _ in results)
    length = "vllm:request_success_total{finished_reason=length}"
    assert after[length] - before[length] == 32


async def _leave_mid_stream(url: str, i: int) -> None:
    body = {"prompt": f"Tell me a long story about {i}", "max_tokens": 100, "stream": True, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 2:
                    return


def test_clients_leaving_mid_stream_free_everything(server: Server) -> None:
    before = wait_idle(server)

    async def main() -> None:
        await asyncio.gather(*(_leave_mid_stream(server.url, i) for i in range(20)))

    asyncio.run(main())
    after = wait_idle(server)  # running 0, waiting 0, KV usage 0
    abort = "vllm:request_success_total{finished_reason=abort}"
    assert after[abort] - before[abort] == 20
    assert httpx.get(server.url + "/health").status_code == 200


async def _timed_post(client: httpx.AsyncClient, i: int) -> tuple[int, float, dict, dict]:
    started = time.monotonic()
    response = await client.post("/v1/completions", json={"prompt": f"Count to {i}", "max_tokens": 8,
                                                           "ignore_eos": True})
    return response.status_code, time.monotonic() - started, dict(response.headers), response.json()


def test_overload_gets_quick_503_while_admitted_finish(server: Server) -> None:
    wait_idle(server)
    burst = MAX_NUM_SEQS + MAX_NUM_QUEUED + 16

    async def main() -> list[tuple[int, float, dict, dict]]:
        limits = httpx.Limits(max_connections=burst)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            return await asyncio.gather(*(_timed_post(client, i) for i in range(burst)))

    results = asyncio.run(main())
    rejected = [r for r in results if r[0] == 503]
    admitted = [r for r in results if r[0] == 200]
    assert len(rejected) + len(admitted) == burst and rejected, [r[0] for r in results]
    assert all(r[2]["retry-after"] == "1" and "max-num-queued-reqs" in r[3]["error"]["message"] for r in rejected)
    assert max(r[1] for r in rejected) < min(r[1] for r in admitted)  # refused before any admitted one ended
    assert all(r[3]["usage"]["completion_tokens"] == 8 for r in admitted)
    assert scrape(server)["conveyor:requests_rejected_total{reason=queue_full}"] == len(rejected)


def test_sigterm_exits_0(server: Server) -> None:
    wait_idle(server)
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=60) == 0, "".join(server.log[-30:])
