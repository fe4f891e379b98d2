"""A real `conveyor serve` on the embedded model: engine-core process + API server, driven by real clients.

One server for the module (slow: loads the model): the official `openai` client, 32 concurrent streams
whose token counts agree with /metrics, 20 clients that leave mid-stream, a burst admitted by vLLM's
in-flight rule, and finally SIGTERM: a short stream finishes, a long one is aborted when the grace runs
out (`finish_reason: "abort"` + `[DONE]`), and both processes exit 0.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections.abc import Iterator

import httpx2 as httpx
import openai
import pytest
from serve_process import Server, running_server, scrape, stream_status, wait_idle

pytestmark = pytest.mark.slow

MAX_NUM_SEQS = 8
MAX_NUM_QUEUED = 32
# The SIGTERM test waits the whole grace: long enough for the short stream's last 5 tokens (~0.1 s at batch 2,
# so 40x slack), no longer. Its long stream must outlast the grace on any CPU: 4,000 tokens in 4 s would be
# 1,000 tok/s at batch 1 (500 tokens no longer did once the CPU decode step went under 16 ms).
GRACE_S = 4
MAX_MODEL_LEN = 4096
LONG_STREAM_TOKENS = 4000
SERVE_ARGS = ["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-queued-reqs",
              str(MAX_NUM_QUEUED), "--shutdown-grace", str(GRACE_S)]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with running_server(SERVE_ARGS) as server:
        yield server


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


def test_burst_admits_exactly_the_in_flight_cap(server: Server) -> None:
    """vLLM >= 0.32: --max-num-queued-reqs caps waiting + running. A burst of 100 on an idle server with
    8 running slots and a cap of 32 admits exactly 32 (8 run, 24 wait) and refuses 68 with 503."""
    before = wait_idle(server)
    statuses: list[tuple[int, dict]] = []
    reason = "vllm:admission_rejections_total{reason=max_num_queued_reqs}"

    async def main() -> dict[str, float]:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            tasks = [asyncio.ensure_future(stream_status(client, i, statuses)) for i in range(100)]
            deadline = time.monotonic() + 60
            while sum(code == 503 for code, _ in statuses) < 100 - MAX_NUM_QUEUED:
                assert time.monotonic() < deadline, statuses
                await asyncio.sleep(0.05)
            while True:  # the gauges are the state after the engine's next step (seconds on a busy CPU)
                metrics = await asyncio.to_thread(scrape, server)
                if metrics["vllm:num_requests_running"] + metrics["vllm:num_requests_waiting"] == MAX_NUM_QUEUED:
                    break
                assert time.monotonic() < deadline, metrics
                await asyncio.sleep(0.1)
            for task in tasks:  # every client leaves: the admitted ones are aborted
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return metrics

    during = asyncio.run(main())
    rejected = [headers for code, headers in statuses if code == 503]
    assert len(rejected) == 100 - MAX_NUM_QUEUED and all(h["retry-after"] == "1" for h in rejected)
    assert during["vllm:num_requests_running"] + during["vllm:num_requests_waiting"] == MAX_NUM_QUEUED
    assert during["vllm:num_requests_running"] == MAX_NUM_SEQS
    assert during[reason] - before[reason] == 100 - MAX_NUM_QUEUED
    assert during["conveyor:requests_rejected_total{reason=max_num_queued_reqs}"] == during[reason]
    wait_idle(server)


def _stream_lines(url: str, max_tokens: int, out: list[str]) -> None:
    body = {"prompt": "Write a poem", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                out.append(line)


def test_sigterm_drains_then_aborts_at_grace_expiry_and_exits_0(server: Server) -> None:
    wait_idle(server)
    short: list[str] = []
    long: list[str] = []
    threads = [threading.Thread(target=_stream_lines, args=(server.url, n, out))
               for n, out in ((6, short), (LONG_STREAM_TOKENS, long))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while not (short and long):  # both streams have started
        assert time.monotonic() < deadline
        time.sleep(0.02)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    late = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=10)
    assert late.status_code == 503 and "shutting down" in late.json()["error"]["message"]
    for thread in threads:
        thread.join(timeout=GRACE_S + 20)
    assert short[-1] == "data: [DONE]" and json.loads(short[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert long[-1] == "data: [DONE]" and json.loads(long[-2][6:])["choices"][0]["finish_reason"] == "abort"
    assert server.proc.wait(timeout=30) == 0, "".join(server.log[-30:])
    assert "grace period over with 1 request(s) in flight" in "".join(server.log)
    assert any("engine core stopped" in line for line in server.log)
