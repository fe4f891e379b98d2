"""Schemathesis fuzzes every operation of /openapi.json (bodies generated from the request models,
valid and invalid); no answer may be a 5xx, and the server answers a plain request afterwards.

The app runs in-process over ASGI with the fake engine (fast: thousands of requests on 2 cores); the
real tokenizer's hostile inputs (lone surrogates, ...) are in test_server_malformed.py's table.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fake_engine import FakeEngine, FakeEngineConfig
from starlette.testclient import TestClient

from conveyor.server.app import build_app
from conveyor.server.server_config import ServerConfig

schemathesis = pytest.importorskip("schemathesis", reason="pip install schemathesis (a dev-only fuzzer)")
from hypothesis import HealthCheck, settings  # noqa: E402

ENGINE = FakeEngine(FakeEngineConfig(token_delay_s=0.0))
APP = build_app(ENGINE, ServerConfig())
SCHEMA = schemathesis.openapi.from_asgi("/openapi.json", APP)


@pytest.fixture(autouse=True, scope="module")
def _stop_grammar_workers() -> Iterator[None]:
    """ASGI without lifespan never shuts the engine down: its grammar compile workers would outlive the
    module as children of the test process (tests/worker/test_tensor_parallel.py counts those)."""
    yield
    ENGINE.grammars.shutdown()


@SCHEMA.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_5xx_under_fuzzing(case) -> None:  # noqa: ANN001 - a schemathesis Case
    response = case.call()
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])


def test_the_server_still_answers_after_fuzzing() -> None:
    with TestClient(APP) as client:
        assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
        assert client.get("/openapi.json").json()["paths"]["/v1/completions"]["post"]["requestBody"]
