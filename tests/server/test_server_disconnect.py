"""Real sockets (uvicorn in a thread, fake engine): clients that go away are aborted and leak nothing."""

from __future__ import annotations

import asyncio
import time

import httpx2 as httpx
import pytest
from fake_engine import FakeEngineConfig
from server_helpers import LiveServer, live_server

pytestmark = pytest.mark.slow  # starts real servers

SLOW = FakeEngineConfig(max_num_seqs=64, token_delay_s=0.01)


def wait_until(predicate, timeout_s: float = 5.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def quiescent(server: LiveServer) -> bool:
    gate = server.app.state.ctx.gate
    return gate.num_in_flight == 0 and not server.engine.state.running and server.engine.state.num_waiting == 0


async def stream_then_leave(url: str, path: str, body: dict, num_chunks: int) -> int:
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        async with client.stream("POST", path, json=body) as response:
            assert response.status_code == 200
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= num_chunks:
                    return seen
    return seen


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_clients_leaving_mid_stream_are_aborted(path: str) -> None:
    # Each endpoint gets only its own fields: an unknown one (messages on /v1/completions) is a 400.
    prompt = {"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"}
    body = {**prompt, "max_tokens": 100, "stream": True}
    with live_server(SLOW) as server:
        async def main() -> None:
            await asyncio.gather(*(stream_then_leave(server.url, path, body, 3) for _ in range(20)))
        asyncio.run(main())
        wait_until(lambda: quiescent(server) and len(server.engine.state.aborted) == 20)
        metrics = httpx.get(server.url + "/metrics").text
        assert 'vllm:num_requests_running{engine="0",model_name="fake-model"} 0.0' in metrics
        assert 'vllm:request_success_total{engine="0",finished_reason="abort",model_name="fake-model"} 20.0' in metrics
        ok = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
        assert ok.status_code == 200


def test_non_streaming_client_timeout_aborts() -> None:
    with live_server(SLOW) as server:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 100}, timeout=0.2)
        wait_until(lambda: quiescent(server) and len(server.engine.state.aborted) == 1)


def test_client_leaving_while_queued_is_aborted() -> None:
    with live_server(FakeEngineConfig(max_num_seqs=1, token_delay_s=0.01)) as server:
        async def main() -> None:
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
                blocker = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 30}))
                while not server.engine.state.running:  # the blocker holds the only running slot
                    await asyncio.sleep(0.005)
                with pytest.raises(httpx.ReadTimeout):  # waits in the queue, headers not sent yet
                    await client.post("/v1/completions", json={"prompt": "y", "max_tokens": 50, "stream": True},
                                      timeout=0.1)
                assert (await blocker).status_code == 200
        asyncio.run(main())
        wait_until(lambda: quiescent(server) and len(server.engine.state.aborted) == 1)
