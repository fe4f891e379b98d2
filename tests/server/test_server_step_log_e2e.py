"""The step log on a real `conveyor serve` (embedded model, CPU): --step-log-size records the engine's steps
across the process boundary, GET /step_log serves them as JSON lines and drains them."""

from __future__ import annotations

import json

import httpx2 as httpx
import pytest
from serve_process import running_server

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("flags", [[], ["--async-scheduling"]], ids=["sync", "async"])
def test_a_request_s_steps_reach_get_step_log(flags: list[str]) -> None:
    """With async scheduling too: a step is logged when its output is applied, one step after its launch."""
    with running_server(["--max-model-len", "512", "--step-log-size", "1000", *flags]) as server:
        httpx.get(server.url + "/step_log", timeout=30)  # start-up steps (none expected): forgotten
        body = {"prompt": "The step log counts tokens.", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        response = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        prompt_tokens = response.json()["usage"]["prompt_tokens"]
        log = httpx.get(server.url + "/step_log", timeout=30)
        assert log.status_code == 200 and log.headers["content-type"] == "application/x-ndjson"
        steps = [json.loads(line) for line in log.text.splitlines()]
        assert sum(s["num_prefill_tokens"] for s in steps) == prompt_tokens
        assert sum(s["num_decode_tokens"] for s in steps) == 3  # the prefill samples the first of 4 tokens
        assert all(s["step_time_s"] > 0 for s in steps)
        assert httpx.get(server.url + "/step_log", timeout=30).text == ""
