"""Malformed requests: each gets a 4xx with OpenAI's error object naming the problem; the server keeps serving."""

from __future__ import annotations

import pytest
from server_helpers import app_client, run

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]

# (id, path, body (dict -> JSON, bytes -> raw), status, text the message must contain, param)
CASES = [
    ("bad-json", COMP, b'{"prompt": "x",', 400, "not valid JSON", None),
    ("invalid-utf8", COMP, b'{"prompt": "\xff\xfe"}', 400, "not valid UTF-8", None),
    ("not-an-object", COMP, b'["prompt"]', 400, "must be a JSON object", None),
    ("deeply-nested", COMP, b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}", 400, "not valid JSON", None),
    ("nan", COMP, b'{"prompt": "x", "temperature": NaN}', 400, "NaN", None),
    ("missing-prompt", COMP, {"max_tokens": 3}, 400, "prompt", "prompt"),
    ("prompt-wrong-type", COMP, {"prompt": 5}, 400, "prompt", "prompt"),
    ("prompt-list-of-lists", COMP, {"prompt": [[1, 2], [3]]}, 400, "batch of 2 prompts", "prompt"),
    ("prompt-two-strings", COMP, {"prompt": ["a", "b"]}, 400, "batch of 2 prompts", "prompt"),
    ("prompt-empty-list", COMP, {"prompt": []}, 400, "must not be empty", "prompt"),
    ("prompt-negative-id", COMP, {"prompt": [1, -3]}, 400, "token ids must be >= 0", "prompt"),
    ("max-tokens-string", COMP, {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens", "max_tokens"),
    ("max-tokens-float", COMP, {"prompt": "x", "max_tokens": 1.5}, 400, "max_tokens", "max_tokens"),
    ("max-tokens-negative", COMP, {"prompt": "x", "max_tokens": -1}, 400, "max_tokens must be >= 1", "max_tokens"),
    ("max-tokens-huge", COMP, {"prompt": "x", "max_tokens": 10**12}, 400, "max_model_len", "max_tokens"),
    ("prompt-too-long", COMP, {"prompt": "x" * 500}, 400, "max_model_len", "prompt"),
    ("temperature-negative", COMP, {"prompt": "x", "temperature": -0.5}, 400, "temperature", "temperature"),
    ("temperature-string", COMP, {"prompt": "x", "temperature": "hot"}, 400, "temperature", "temperature"),
    ("top-p-above-one", COMP, {"prompt": "x", "top_p": 1.5}, 400, "top_p", "top_p"),
    ("logprobs-above-20", COMP, {"prompt": "x", "logprobs": 21}, 400, "logprobs", "logprobs"),
    ("stop-wrong-type", COMP, {"prompt": "x", "stop": 7}, 400, "stop", "stop"),
    ("stop-token-ids-strings", COMP, {"prompt": "x", "stop_token_ids": ["a"]}, 400, "stop_token_ids",
     "stop_token_ids.0"),
    ("n-zero", COMP, {"prompt": "x", "n": 0}, 400, "n: must be in [1, 128]", "n"),
    ("n-greedy", COMP, {"prompt": "x", "n": 2, "temperature": 0}, 400, "greedy", "n"),
    ("unknown-field", COMP, {"prompt": "x", "max_token": 5}, 400, "max_token: unknown field", "max_token"),
    ("beam-search", COMP, {"prompt": "x", "use_beam_search": True}, 400, "beam search", "use_beam_search"),
    ("surrogate-prompt", COMP, b'{"prompt": "a\\ud800b"}', 400, "lone UTF-16 surrogate", "prompt"),
    ("surrogate-key", COMP, b'{"prompt": "x", "\\udfff": 1}', 400, "lone UTF-16 surrogate", r"\udfff"),
    ("temperature-infinite", COMP, b'{"prompt": "x", "temperature": 1e400}', 400, "finite", "temperature"),
    ("temperature-above-2", COMP, {"prompt": "x", "temperature": 1000}, 400, "[0, 2]", "temperature"),
    ("repetition-penalty-zero", COMP, {"prompt": "x", "repetition_penalty": 0.0}, 400, "> 0", "repetition_penalty"),
    ("seed-beyond-int64", COMP, {"prompt": "x", "seed": 2**70}, 400, "seed", "seed"),
    ("priority-beyond-int64", COMP, {"prompt": "x", "priority": -2**70}, 400, "priority", "priority"),
    ("logit-bias-bad-key", COMP, {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "token ids", "logit_bias"),
    ("logit-bias-out-of-vocab", COMP, {"prompt": "x", "logit_bias": {"1000000000": 1}}, 400, "out of range",
     "logit_bias"),
    ("regex-does-not-compile", COMP, {"prompt": "x", "structured_outputs": {"regex": "("}}, 400, "does not compile",
     "structured_outputs.regex"),
    # issue 34: a GBNF grammar that does not parse was an uncaught GbnfToLarkError, a 500.
    ("gbnf-does-not-parse", COMP, {"prompt": "hi", "max_tokens": 4, "guided_grammar": "root ::= ("}, 400,
     "does not compile", "guided_grammar"),
    ("gbnf-does-not-parse-structured", COMP, {"prompt": "hi", "structured_outputs": {"grammar": "root ::= ("}}, 400,
     "does not compile", "structured_outputs.grammar"),
    ("lark-does-not-parse", COMP, {"prompt": "hi", "guided_grammar": "start: ("}, 400, "does not compile",
     "guided_grammar"),
    ("guided-regex-does-not-compile", COMP, {"prompt": "x", "guided_regex": "a)"}, 400, "does not compile",
     "guided_regex"),
    ("guided-json-bad-type", COMP, {"prompt": "x", "guided_json": {"type": 5}}, 400, "does not compile",
     "guided_json"),
    ("guided-json-dangling-ref", COMP, {"prompt": "x", "guided_json": {"$ref": "#/nope"}}, 400,
     "does not compile", "guided_json"),
    ("guided-json-not-an-object", COMP, {"prompt": "x", "guided_json": [1]}, 400, "guided_json", "guided_json"),
    ("guided-choice-empty-string", COMP, {"prompt": "x", "guided_choice": ["a", ""]}, 400, "non-empty",
     "guided_choice"),
    ("guided-choice-not-strings", COMP, {"prompt": "x", "guided_choice": [1, 2]}, 400, "guided_choice",
     "guided_choice.0"),
    ("choice-empty", COMP, {"prompt": "x", "structured_outputs": {"choice": []}}, 400, "non-empty",
     "structured_outputs.choice"),
    ("schema-does-not-compile-chat", CHAT, {"messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}}, 400, "does not compile",
     "response_format.json_schema.schema"),
    ("two-constraints", COMP, {"prompt": "x", "guided_regex": "a", "guided_choice": ["b"]}, 400,
     "only one structured-outputs constraint", "guided_choice"),
    ("bad-json-schema", COMP, {"prompt": "x", "guided_json": "{not json"}, 400, "JSON schema", "guided_json"),
    # issue 34: vLLM 0.33's 400s where conveyor generated on.
    ("stop-token-ids-out-of-vocab", COMP, {"prompt": "x", "stop_token_ids": [10**12]}, 400, "out of range",
     "stop_token_ids"),
    ("min-tokens-past-the-context", CHAT, {"messages": USER, "min_tokens": 10**9}, 400,
     "min_tokens (1000000000) exceeds", "min_tokens"),
    ("min-tokens-past-max-tokens-null", COMP, {"prompt": "x", "max_tokens": None, "min_tokens": 10**9}, 400,
     "min_tokens", "min_tokens"),
    ("detokenize-out-of-vocab", "/detokenize", {"tokens": [99999999]}, 400, "token id 99999999 is out of range",
     "tokens"),
    ("detokenize-negative", "/detokenize", {"tokens": [-1]}, 400, "token id -1 is out of range", "tokens"),
    ("best-of", COMP, {"prompt": "x", "best_of": 3}, 400, "best_of", "best_of"),
    ("suffix", COMP, {"prompt": "x", "suffix": "tail"}, 400, "suffix", "suffix"),
    ("echo-with-logprobs", COMP, {"prompt": "x", "echo": True, "logprobs": 1}, 400, "echo", "echo"),
    ("stream-options-no-stream", COMP, {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options", "stream_options"),
    ("stream-not-bool", COMP, {"prompt": "x", "stream": "yes"}, 400, "stream", "stream"),
    ("penalty-out-of-range", COMP, {"prompt": "x", "presence_penalty": 3.0}, 400, "presence_penalty",
     "presence_penalty"),
    ("min-tokens-over-max", COMP, {"prompt": "x", "max_tokens": 2, "min_tokens": 5}, 400, "min_tokens",
     "min_tokens"),
    ("unknown-model", COMP, {"prompt": "x", "model": "gpt-9"}, 404, "The model `gpt-9` does not exist.", "model"),
    ("empty-messages", CHAT, {"messages": []}, 400, "at least one message", "messages"),
    ("missing-messages", CHAT, {"max_tokens": 2}, 400, "messages", "messages"),
    ("wrong-role", CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400, "role", "messages.0.role"),
    ("content-image", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "text", "messages.0.content"),
    ("content-number", CHAT, {"messages": [{"role": "user", "content": 3}]}, 400, "content", "messages.0.content"),
    ("chat-n-greedy", CHAT, {"messages": USER, "n": 3, "temperature": 0}, 400, "greedy", "n"),
    ("surrogate-chat", CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400,
     "lone UTF-16 surrogate", "messages.0.content"),
    ("chat-template-from-request", CHAT, {"messages": USER, "chat_template": "{{x}}"}, 400, "chat template",
     "chat_template"),
    ("surrogate-tokenize", "/tokenize", b'{"prompt": "\\udc00"}', 400, "lone UTF-16 surrogate", "prompt"),
    ("tokenize-empty-messages", "/tokenize", {"messages": []}, 400, "at least one message", "messages"),
    ("chat-tools", CHAT, {"messages": USER, "tools": [{"type": "function"}]}, 400, "tool", "tools"),
    ("top-logprobs-without-logprobs", CHAT, {"messages": USER, "top_logprobs": 2}, 400, "logprobs",
     "top_logprobs"),
    ("chat-max-completion-tokens-huge", CHAT, {"messages": USER, "max_completion_tokens": 100000}, 400,
     "max_model_len", "max_tokens"),
    ("bad-response-format", CHAT, {"messages": USER, "response_format": {"type": "yaml"}}, 400,
     "response_format.type", "response_format.type"),
]


@pytest.mark.parametrize(("path", "body", "status", "needle", "param"),
                         [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_malformed_request_gets_a_clear_4xx_and_server_keeps_serving(path, body, status, needle, param) -> None:
    async def main() -> None:
        async with app_client() as client:
            if isinstance(body, bytes):
                response = await client.post(path, content=body, headers={"content-type": "application/json"})
            else:
                response = await client.post(path, json=body)
            assert response.status_code == status, response.text
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert needle in error["message"]
            assert error["param"] == param
            assert error["code"] == status
            ok = await client.post(COMP, json={"prompt": "still alive", "max_tokens": 2})
            assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == " w0 w1"
    run(main())


def test_oversized_body_is_413() -> None:
    async def main() -> None:
        async with app_client(max_request_body_bytes=1024) as client:
            response = await client.post(COMP, json={"prompt": "x" * 5000})
            assert response.status_code == 413
            assert "1024 bytes" in response.json()["error"]["message"]
            assert (await client.post(COMP, json={"prompt": "ok", "max_tokens": 1})).status_code == 200
    run(main())


def test_unknown_route_and_method_use_the_error_object() -> None:
    async def main() -> None:
        async with app_client() as client:
            missing = await client.get("/v1/nothing")
            assert missing.status_code == 404 and "error" in missing.json()
            wrong_method = await client.get(COMP)
            assert wrong_method.status_code == 405 and "error" in wrong_method.json()
    run(main())


def test_rejections_are_counted() -> None:
    async def main() -> None:
        async with app_client() as client:
            await client.post(COMP, json={"prompt": "x", "n": 0})
            await client.post(COMP, json={"prompt": "x", "model": "nope"})
            text = (await client.get("/metrics")).text
            assert 'conveyor:requests_rejected_total{model_name="fake-model",reason="invalid_request"} 2.0' in text
    run(main())
