"""Prefix-cache isolation on a real `conveyor serve` (embedded model, --enable-prompt-tokens-details): the
same prompt twice hits with the same `cache_salt` and misses with another one or after
`POST /reset_prefix_cache`; a reset while a stream runs is refused unless it preempts, and the
preempted stream still finishes whole. Hits are read where a benchmark reads them: the responses'
`usage.prompt_tokens_details.cached_tokens`, and the `vllm:prefix_cache_hits` counter."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx2 as httpx
import pytest
from serve_process import Server, running_server, scrape, wait_idle

pytestmark = pytest.mark.slow

PROMPT = "Every run stands on its own: " + "the cache of one run must never serve the next one. " * 8
HITS = "vllm:prefix_cache_hits_total"
STREAM_TOKENS = 100
"""The reset test's stream: it only has to outlast two /reset_prefix_cache calls (~1 s of decode at batch 1
on one core against a few ms for the calls, a ratio that holds on a loaded machine too); every token more
is decode time, twice (sync and async), plus its recompute after the preemption."""


@pytest.fixture(scope="module", params=[[], ["--async-scheduling"]], ids=["sync", "async"])
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    """Sync and async scheduling (CUDA's default): a forced reset lands with a step in flight there."""
    with running_server(["--max-model-len", "1024", "--enable-prompt-tokens-details", *request.param]) as server:
        yield server


def _cached_tokens(server: Server, path: str = "/v1/completions", **fields: object) -> int:
    body: dict[str, object] = {"max_tokens": 1, "temperature": 0, **fields}
    if path == "/v1/completions":
        body["prompt"] = PROMPT
    else:
        body["messages"] = [{"role": "user", "content": PROMPT}]
    response = httpx.post(server.url + path, json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_salt_and_reset_isolate_runs(server: Server) -> None:
    hits_before = scrape(server).get(HITS, 0)
    assert _cached_tokens(server, cache_salt="run-1") == 0
    assert _cached_tokens(server, cache_salt="run-1") > 0  # same salt: shared as without salts
    assert _cached_tokens(server, cache_salt="run-2") == 0  # another run: nothing shared
    assert _cached_tokens(server) == 0  # no salt is a namespace of its own
    hits = _cached_tokens(server)
    assert hits > 0 and scrape(server).get(HITS, 0) - hits_before >= 2 * hits
    chat = _cached_tokens(server, "/v1/chat/completions", cache_salt="run-1")
    assert _cached_tokens(server, "/v1/chat/completions", cache_salt="run-1") > chat
    reset = httpx.post(server.url + "/reset_prefix_cache", timeout=30)
    assert reset.status_code == 200
    for salt in ("run-1", None):
        assert _cached_tokens(server, **({"cache_salt": salt} if salt else {})) == 0  # reset: a cold cache
    assert _cached_tokens(server, "/v1/chat/completions", cache_salt="run-1") == 0


def test_reset_while_a_stream_runs(server: Server) -> None:
    result: dict[str, object] = {}

    def stream() -> None:
        body = {"prompt": PROMPT, "max_tokens": STREAM_TOKENS, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}, "cache_salt": "long"}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as response:
            result["text"] = response.read().decode()

    thread = threading.Thread(target=stream)
    thread.start()
    try:
        while scrape(server).get("vllm:num_requests_running", 0) == 0:
            assert thread.is_alive(), result
        refused = httpx.post(server.url + "/reset_prefix_cache", timeout=30)
        assert refused.status_code == 409 and refused.json()["error"]["param"] == "reset_running_requests"
        forced = httpx.post(server.url + "/reset_prefix_cache?reset_running_requests=true", timeout=30)
        assert forced.status_code == 200
    finally:
        thread.join(timeout=120)
    text = str(result["text"])
    assert '"finish_reason":"length"' in text and f'"completion_tokens":{STREAM_TOKENS}' in text
    assert text.endswith("[DONE]\n\n")
    assert wait_idle(server)["vllm:num_preemptions_total"] >= 1
