"""Prefix-cache isolation over the fake engine: `cache_salt` on both endpoints (carried to the engine,
validated as vLLM), and `POST /reset_prefix_cache` reaching the engine."""

from __future__ import annotations

import asyncio

from fake_engine import FakeEngine, FakeEngineConfig
from server_helpers import app_client, run

COMP = "/v1/completions"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def test_cache_salt_reaches_the_engine_from_both_endpoints() -> None:
    async def main() -> None:
        engine = FakeEngine()
        async with app_client(engine) as client:
            assert (await client.post(COMP, json={"prompt": "x", "max_tokens": 1, "cache_salt": "run-1"})).status_code == 200
            assert (await client.post(CHAT, json={"messages": USER, "max_tokens": 1, "cache_salt": "run-2"})).status_code == 200
            assert (await client.post(COMP, json={"prompt": "x", "max_tokens": 1})).status_code == 200
        assert [request.cache_salt for request in engine.state.requests] == ["run-1", "run-2", None]
    run(main())


def test_bad_cache_salt_is_a_400_naming_it() -> None:
    async def main() -> None:
        engine = FakeEngine()
        async with app_client(engine) as client:
            for path, body in ((COMP, {"prompt": "x"}), (CHAT, {"messages": USER})):
                for salt in ("", 7, ["a"]):
                    response = await client.post(path, json={**body, "cache_salt": salt})
                    error = response.json()["error"]
                    assert response.status_code == 400 and error["param"] == "cache_salt", (path, salt, error)
            assert (await client.post(COMP, json={"prompt": "x", "max_tokens": 1, "cache_salt": None})).status_code == 200
        assert [request.cache_salt for request in engine.state.requests] == [None]
    run(main())


def test_reset_prefix_cache_reaches_the_engine() -> None:
    async def main() -> None:
        engine = FakeEngine()
        async with app_client(engine) as client:
            response = await client.post("/reset_prefix_cache")
            assert response.status_code == 200 and engine.state.num_prefix_cache_resets == 1
            for flags in ("reset_running_requests=true", "reset_running_requests=0&reset_external=True"):
                assert (await client.post(f"/reset_prefix_cache?{flags}")).status_code == 200
            response = await client.post("/reset_prefix_cache?reset_running_requests=maybe")
            assert response.status_code == 400 and response.json()["error"]["param"] == "reset_running_requests"
        assert engine.state.num_prefix_cache_resets == 3
    run(main())


def test_reset_while_requests_run_is_refused_unless_forced() -> None:
    """vLLM's engine refuses (False) while requests hold KV blocks; conveyor says so with a 409 (vLLM
    answers 200 regardless) and resets when told to preempt them."""
    async def main() -> None:
        engine = FakeEngine(FakeEngineConfig(token_delay_s=0.02))
        async with app_client(engine) as client:
            running = asyncio.create_task(client.post(COMP, json={"prompt": "x", "max_tokens": 20}))
            while not engine.state.running:
                await asyncio.sleep(0.005)
            refused = await client.post("/reset_prefix_cache")
            assert refused.status_code == 409 and refused.json()["error"]["param"] == "reset_running_requests"
            assert engine.state.num_prefix_cache_resets == 0
            assert (await client.post("/reset_prefix_cache?reset_running_requests=true")).status_code == 200
            assert (await running).status_code == 200
            assert (await client.post("/reset_prefix_cache")).status_code == 200
        assert engine.state.num_prefix_cache_resets == 2
    run(main())
