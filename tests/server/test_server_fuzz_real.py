"""Schemathesis against a real `conveyor serve` process: the embedded SmolLM2, its real tokenizer and
the engine-core process behind the HTTP surface (test_server_fuzz.py fuzzes the app in-process, fast,
over the fake engine). No answer may be a 5xx, and afterwards the server still answers and its
engine holds no request and no KV block (nothing accepted was lost)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx2 as httpx
import pytest
from serve_process import Server, running_server, wait_idle

schemathesis = pytest.importorskip("schemathesis", reason="pip install schemathesis (a dev-only fuzzer)")
from hypothesis import HealthCheck, given, settings  # noqa: E402

pytestmark = pytest.mark.slow

# Short lengths keep each generated request to a few decode steps on 2 cores.
SERVE_ARGS = ["--max-model-len", "48", "--max-num-seqs", "8", "--kv-cache-memory", "64MiB"]


@pytest.fixture(scope="module")
def real_server() -> Iterator[Server]:
    with running_server(SERVE_ARGS) as server:
        yield server


def test_no_5xx_from_a_real_server(real_server: Server) -> None:
    schema = schemathesis.openapi.from_url(f"{real_server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert any(op.path == "/v1/chat/completions" for op in operations)
    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def no_5xx(case) -> None:  # noqa: ANN001 - a schemathesis Case
            response = case.call(timeout=60)
            assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])

        no_5xx()


def test_the_real_server_still_answers_and_holds_nothing(real_server: Server) -> None:
    reply = httpx.post(f"{real_server.url}/v1/completions", timeout=60,
                       json={"model": real_server.model, "prompt": "Hi", "max_tokens": 2})
    assert reply.status_code == 200, reply.text
    metrics = wait_idle(real_server)  # running, waiting and KV usage back to 0
    assert metrics["vllm:num_requests_running"] == 0 and metrics["vllm:kv_cache_usage_perc"] == 0
