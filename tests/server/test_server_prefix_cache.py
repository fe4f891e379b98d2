"""Prefix-cache isolation over the fake engine: `cache_salt` on both endpoints (carried to the engine,
validated as vLLM), and `POST /reset_prefix_cache` reaching the engine."""

from __future__ import annotations

from fake_engine import FakeEngine
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
