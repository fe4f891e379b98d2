"""The OpenAI endpoints over the fake engine, in process: shapes, streaming, auth, overload, failures."""

from __future__ import annotations

import asyncio

from fake_engine import FakeEngine, FakeEngineConfig, output_text
from server_helpers import app_client, run, sse_events

from conveyor.request import FinishReason

COMP = "/v1/completions"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def test_completion_shape_and_usage() -> None:
    async def main() -> None:
        async with app_client() as client:
            body = (await client.post(COMP, json={"prompt": "hello", "max_tokens": 3, "model": "fake-model"})).json()
            assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
            assert body["model"] == "fake-model" and isinstance(body["created"], int)
            assert body["choices"] == [{"index": 0, "text": output_text(3), "logprobs": None,
                                        "finish_reason": "length", "stop_reason": None}]
            assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 3, "total_tokens": 9, "prompt_tokens_details": None}
    run(main())


def test_token_id_prompts_and_defaults() -> None:
    async def main() -> None:
        engine = FakeEngine()
        async with app_client(engine) as client:
            body = (await client.post(COMP, json={"prompt": [[5, 6, 7]]})).json()
            assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 16  # OpenAI default
            assert engine.state.requests[-1].prompt_token_ids == [5, 6, 7]
    run(main())


def test_sampling_fields_reach_the_engine() -> None:
    async def main() -> None:
        engine = FakeEngine()
        async with app_client(engine) as client:
            await client.post(COMP, json={"prompt": "x", "max_tokens": 4, "temperature": 0, "top_p": 0.5, "top_k": -1,
                                          "seed": 7, "stop": "END", "stop_token_ids": [9], "ignore_eos": True,
                                          "min_tokens": 1, "repetition_penalty": 1.1, "priority": 3, "user": "u"})
            request = engine.state.requests[-1]
            params = request.sampling_params
            assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.0, 0.5, None, 7)
            assert params.stop == ("END",) and params.stop_token_ids == (9,) and params.ignore_eos
            assert params.min_tokens == 1 and params.repetition_penalty == 1.1 and request.priority == 3
    run(main())


def test_stop_token_finish_reason_and_stop_reason() -> None:
    async def main() -> None:
        async with app_client() as client:
            body = (await client.post(COMP, json={"prompt": "x", "max_tokens": 10, "stop_token_ids": [1002]})).json()
            assert body["choices"][0]["finish_reason"] == "stop" and body["choices"][0]["stop_reason"] == 1002
            assert body["usage"]["completion_tokens"] == 3
    run(main())


def test_completion_stream_with_usage() -> None:
    async def main() -> None:
        async with app_client() as client:
            response = await client.post(COMP, json={"prompt": "hey", "max_tokens": 4, "stream": True,
                                                     "stream_options": {"include_usage": True}})
            assert response.headers["content-type"].startswith("text/event-stream")
            events = sse_events(response.text)
            assert events[-1] == "[DONE]"
            chunks = events[:-2]
            assert "".join(c["choices"][0]["text"] for c in chunks) == output_text(4)
            assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
            assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
            assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 4
    run(main())


def test_every_new_token_gets_a_chunk_even_with_held_back_text() -> None:
    """As vLLM: a token whose text the detokenizer holds back still gets its (empty-text) chunk, so
    clients count one chunk per token and ITL measures token gaps, not text gaps."""
    async def main() -> None:
        engine = FakeEngine(FakeEngineConfig(held_back_tokens=frozenset({1, 2})))
        async with app_client(engine) as client:
            events = sse_events((await client.post(COMP, json={"prompt": "x", "max_tokens": 4, "stream": True})).text)
            assert [e["choices"][0]["text"] for e in events[:-1]] == [" w0", "", "", " w1 w2 w3"]
            chat = sse_events((await client.post(CHAT, json={"messages": USER, "max_tokens": 4, "stream": True})).text)
            assert [e["choices"][0]["delta"]["content"] for e in chat[1:-1]] == [" w0", "", "", " w1 w2 w3"]
    run(main())


def test_stream_without_usage_has_no_usage_chunk() -> None:
    async def main() -> None:
        async with app_client() as client:
            events = sse_events((await client.post(COMP, json={"prompt": "x", "max_tokens": 2, "stream": True})).text)
            assert len(events) == 3 and all(e == "[DONE]" or e["choices"] for e in events)
    run(main())


def test_echo_and_logprobs() -> None:
    async def main() -> None:
        async with app_client() as client:
            echo = (await client.post(COMP, json={"prompt": "abc", "max_tokens": 2, "echo": True})).json()
            assert echo["choices"][0]["text"] == "abc" + output_text(2)
            lp = (await client.post(COMP, json={"prompt": "abc", "max_tokens": 2, "logprobs": 2})).json()
            logprobs = lp["choices"][0]["logprobs"]
            assert logprobs["tokens"] == [" w0", " w1"] and logprobs["token_logprobs"] == [-0.5, -0.5]
            assert logprobs["text_offset"] == [0, 3] and len(logprobs["top_logprobs"][0]) == 3
    run(main())


def test_chat_completion_and_stream() -> None:
    async def main() -> None:
        engine = FakeEngine()
        async with app_client(engine) as client:
            body = (await client.post(CHAT, json={"messages": USER, "max_completion_tokens": 2})).json()
            assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
            assert body["choices"][0]["message"] == {"role": "assistant", "content": output_text(2)}
            assert engine.state.requests[-1].prompt_token_ids == [ord(c) for c in "<user>hi\n<assistant>"]
            events = sse_events((await client.post(CHAT, json={
                "messages": USER, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True},
                "logprobs": True, "top_logprobs": 1})).text)
            assert events[0]["choices"][0]["delta"]["role"] == "assistant"
            content = events[1:-2]
            assert all(c["object"] == "chat.completion.chunk" for c in content)
            assert "".join(c["choices"][0]["delta"]["content"] for c in content) == output_text(3)
            assert content[-1]["choices"][0]["finish_reason"] == "length"
            assert content[0]["choices"][0]["logprobs"]["content"][0]["top_logprobs"][1]["token"] == " alt0"
            assert events[-2]["usage"]["completion_tokens"] == 3 and events[-1] == "[DONE]"
    run(main())


def test_chat_default_max_tokens_fills_the_context() -> None:
    async def main() -> None:
        async with app_client(FakeEngine(FakeEngineConfig(max_model_len=40))) as client:
            body = (await client.post(CHAT, json={"messages": [{"role": "system", "content": [
                {"type": "text", "text": "be"}, {"type": "text", "text": " brief"}]}, *USER]})).json()
            assert body["usage"]["total_tokens"] == 40
    run(main())


def test_api_key() -> None:
    async def main() -> None:
        async with app_client(api_keys=("other", "sekret")) as client:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
                response = await client.post(COMP, json={"prompt": "x"}, headers=headers)
                assert response.status_code == 401 and "API key" in response.json()["error"]["message"]
                assert response.json()["error"]["type"] == "authentication_error"
            assert (await client.get("/v1/models")).status_code == 401
            ok = await client.post(COMP, json={"prompt": "x", "max_tokens": 1},
                                   headers={"Authorization": "Bearer sekret"})
            assert ok.status_code == 200
            for route in ("/tokenize", "/detokenize", "/invocations", "/reset_prefix_cache"):
                assert (await client.post(route, json={})).status_code == 401, route
            for route in ("/health", "/ping", "/metrics", "/version", "/load"):
                assert (await client.get(route)).status_code == 200, route  # probes and scrapers stay open
    run(main())


def test_in_flight_cap_is_503_with_retry_after_while_admitted_finish() -> None:
    """--max-num-queued-reqs counts waiting + running (vLLM >= 0.32): cap 2, one running, one waiting."""
    async def main() -> None:
        engine = FakeEngine(FakeEngineConfig(max_num_seqs=1, max_num_queued_reqs=2, token_delay_s=0.01))
        async with app_client(engine) as client:
            admitted = [asyncio.ensure_future(client.post(COMP, json={"prompt": "x", "max_tokens": 10}))
                        for _ in range(2)]
            await asyncio.sleep(0.03)  # one running, one waiting: two in flight
            rejected = await client.post(COMP, json={"prompt": "x", "max_tokens": 10})
            assert rejected.status_code == 503 and rejected.headers["retry-after"] == "1"
            assert "--max-num-queued-reqs=2" in rejected.json()["error"]["message"]
            assert [r.status_code for r in await asyncio.gather(*admitted)] == [200, 200]
            again = await client.post(COMP, json={"prompt": "x", "max_tokens": 1})
            assert again.status_code == 200  # finished requests leave the count
            metrics = (await client.get("/metrics")).text
            labels = 'model_name="fake-model",reason="max_num_queued_reqs"'
            assert f"conveyor:requests_rejected_total{{{labels}}} 1.0" in metrics
            assert f"vllm:admission_rejections_total{{{labels}}} 1.0" in metrics
    run(main())


def test_prefill_token_cap_counts_prompts_until_their_first_token() -> None:
    async def main() -> None:
        engine = FakeEngine(FakeEngineConfig(max_num_seqs=1, max_num_queued_tokens=5, token_delay_s=0.01))
        async with app_client(engine) as client:
            running = asyncio.ensure_future(client.post(COMP, json={"prompt": "abcd", "max_tokens": 10}))
            await asyncio.sleep(0.03)  # it has produced tokens: its 5 prompt tokens no longer count
            waiting = asyncio.ensure_future(client.post(COMP, json={"prompt": "abcdefgh", "max_tokens": 2}))
            await asyncio.sleep(0.005)  # 9 prompt tokens wait for prefill: at the cap
            rejected = await client.post(COMP, json={"prompt": "x", "max_tokens": 1})
            assert rejected.status_code == 503 and "--max-num-queued-tokens=5" in rejected.json()["error"]["message"]
            assert [r.status_code for r in await asyncio.gather(running, waiting)] == [200, 200]
            metrics = (await client.get("/metrics")).text
            assert 'vllm:admission_rejections_total{model_name="fake-model",reason="max_num_queued_tokens"} 1.0' in metrics
    run(main())


def test_queue_timeout_is_503_with_retry_after_streamed_or_not() -> None:
    """A request that never ran gets a real 503, also with stream: true (no 200 before its first output)."""
    async def main() -> None:
        engine = FakeEngine(FakeEngineConfig(max_num_seqs=1, queue_timeout_s=0.05, token_delay_s=0.02))
        async with app_client(engine) as client:
            blocker = asyncio.ensure_future(client.post(COMP, json={"prompt": "x", "max_tokens": 20}))
            await asyncio.sleep(0.01)
            for stream in (False, True):
                timed_out = await client.post(COMP, json={"prompt": "x", "max_tokens": 2, "stream": stream})
                assert timed_out.status_code == 503 and timed_out.headers["retry-after"] == "1"
                assert timed_out.json()["error"]["type"] == "timeout_error"
                assert "queue timeout" in timed_out.json()["error"]["message"]
            assert (await blocker).status_code == 200
            assert 'conveyor:queue_timeouts_total{engine="0",model_name="fake-model"} 2.0' in (await client.get("/metrics")).text
    run(main())


def test_dead_engine_503_and_health() -> None:
    async def main() -> None:
        engine = FakeEngine()
        async with app_client(engine) as client:
            assert (await client.get("/health")).status_code == 200
            engine.dead = True
            response = await client.post(COMP, json={"prompt": "x"})
            assert response.status_code == 503 and "engine has stopped" in response.json()["error"]["message"]
            assert (await client.get("/health")).status_code == 503
    run(main())


def test_a_frozen_engine_fails_health_after_the_check_timeout(caplog: pytest.LogCaptureFixture) -> None:
    """The engine's process still exists (is_running), but its core answers nothing: /health and /ping
    are 503 once --health-check-timeout has passed, the log says why, and 200 again once it answers."""
    async def main() -> None:
        engine = FakeEngine()
        async with app_client(engine, health_check_timeout_s=0.2) as client:
            assert (await client.get("/health")).status_code == 200
            engine.state.frozen = True
            assert (await client.get("/health")).status_code == 503
            assert (await client.get("/ping")).status_code == 503
            assert "did not answer within 0.2 s" in caplog.text
            engine.state.frozen = False
            assert (await client.get("/health")).status_code == 200
    run(main())


def test_draining_refuses_new_requests_and_fails_health() -> None:
    async def main() -> None:
        async with app_client() as client:
            client.app.state.ctx.gate.start_draining()
            response = await client.post(CHAT, json={"messages": USER})
            assert response.status_code == 503 and "shutting down" in response.json()["error"]["message"]
            assert (await client.get("/health")).status_code == 503
    run(main())


def test_models_version_tokenize_detokenize() -> None:
    async def main() -> None:
        async with app_client() as client:
            models = (await client.get("/v1/models")).json()
            assert models["object"] == "list" and models["data"][0]["id"] == "fake-model"
            assert models["data"][0]["max_model_len"] == 128
            assert "version" in (await client.get("/version")).json()
            tokens = (await client.post("/tokenize", json={"prompt": "ab"})).json()
            assert tokens == {"count": 3, "max_model_len": 128, "tokens": [1, 97, 98]}
            chat_tokens = (await client.post("/tokenize", json={"messages": USER})).json()
            assert chat_tokens["count"] == len("<user>hi\n<assistant>")
            assert (await client.post("/detokenize", json={"tokens": [104, 105]})).json() == {"prompt": "hi"}
            assert (await client.post("/detokenize", json={"tokens": ["a"]})).status_code == 400
            assert (await client.post("/tokenize", json={})).status_code == 400
    run(main())


def test_completions_max_tokens_null_is_16_as_vllm() -> None:
    """Issue 34: an explicit `max_tokens: null` generated to the context limit (2,044 tokens); vLLM 0.33
    answers it with its default, 16. Chat keeps "up to the context limit", as in vLLM."""
    async def main() -> None:
        async with app_client() as client:
            answer = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": None})
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 16
            chat = await client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": None})
            assert chat.json()["usage"]["completion_tokens"] > 16
    run(main())


def test_every_request_finishes_or_is_aborted() -> None:
    async def main() -> None:
        engine = FakeEngine(FakeEngineConfig(token_delay_s=0.001))
        async with app_client(engine) as client:
            await asyncio.gather(*(client.post(COMP, json={"prompt": "x", "max_tokens": 5, "stream": i % 2 == 0})
                                   for i in range(12)))
            assert client.app.state.ctx.gate.num_in_flight == 0
            assert list(engine.state.finished.values()) == [FinishReason.LENGTH] * 12
    run(main())
