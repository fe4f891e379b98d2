"""The model's default sampling parameters (--generation-config) in requests, over the fake engine: a field
the request leaves unset takes the model's value, else vLLM's built-in one; a field it sets wins."""

from __future__ import annotations

from fake_engine import FakeEngine
from server_helpers import app_client, run

from conveyor.engine.generation_defaults import SamplingDefaults
from conveyor.sampling_params import SamplingParams

COMP = "/v1/completions"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
LLAMA_31 = SamplingDefaults(temperature=0.6, top_p=0.9)


def _params(defaults: SamplingDefaults, path: str, body: dict) -> SamplingParams | int:
    """The SamplingParams the engine got for `body` (or the status of a refusal)."""
    async def main() -> SamplingParams | int:
        engine = FakeEngine()
        async with app_client(engine, sampling_defaults=defaults) as client:
            response = await client.post(path, json=body)
            if response.status_code != 200:
                return response.status_code
            return engine.state.requests[-1].sampling_params
    return run(main())  # type: ignore[return-value]


def test_a_request_that_sets_nothing_samples_at_the_models_defaults() -> None:
    for path, body in ((CHAT, {"messages": USER}), (COMP, {"prompt": "hi"})):
        params = _params(LLAMA_31, path, body)
        assert isinstance(params, SamplingParams)
        assert (params.temperature, params.top_p) == (0.6, 0.9), path


def test_a_field_the_request_sets_wins() -> None:
    params = _params(LLAMA_31, CHAT, {"messages": USER, "temperature": 1.0})
    assert isinstance(params, SamplingParams) and (params.temperature, params.top_p) == (1.0, 0.9)
    params = _params(SamplingDefaults(top_k=20), CHAT, {"messages": USER, "top_k": -1})  # -1: no top-k, as asked
    assert isinstance(params, SamplingParams) and params.top_k is None


def test_every_default_field_reaches_the_engine() -> None:
    defaults = SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20, min_p=0.05, repetition_penalty=1.05)
    params = _params(defaults, CHAT, {"messages": USER})
    assert isinstance(params, SamplingParams)
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty) == \
        (0.7, 0.8, 20, 0.05, 1.05)


def test_without_defaults_vllms_built_in_ones_apply() -> None:
    params = _params(SamplingDefaults(), CHAT, {"messages": USER})
    assert isinstance(params, SamplingParams)
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty) == \
        (1.0, 1.0, None, 0.0, 1.0)


def test_max_new_tokens_is_the_chat_default_and_a_request_may_ask_for_more() -> None:
    defaults = SamplingDefaults(max_tokens=7)
    params = _params(defaults, CHAT, {"messages": USER})
    assert isinstance(params, SamplingParams) and params.max_tokens == 7
    params = _params(defaults, CHAT, {"messages": USER, "max_completion_tokens": 20})
    assert isinstance(params, SamplingParams) and params.max_tokens == 20
    params = _params(defaults, COMP, {"prompt": "hi"})  # completions' own default is 16 (vLLM's field default)
    assert isinstance(params, SamplingParams) and params.max_tokens == 16


def test_an_override_or_path_max_new_tokens_caps_every_request() -> None:
    """vLLM's override_max_tokens: min(request's, the cap), for chat and completions."""
    capped = SamplingDefaults(max_tokens=7, max_tokens_cap=7)
    for path, body in ((CHAT, {"messages": USER, "max_tokens": 20}), (COMP, {"prompt": "hi", "max_tokens": 20})):
        params = _params(capped, path, body)
        assert isinstance(params, SamplingParams) and params.max_tokens == 7, path


def test_n_above_one_is_checked_against_the_effective_temperature() -> None:
    greedy = SamplingDefaults(temperature=0.0)
    assert _params(greedy, CHAT, {"messages": USER, "n": 2}) == 400  # temperature 0 from the model's default
    params = _params(greedy, CHAT, {"messages": USER, "n": 2, "temperature": 0.5})
    assert isinstance(params, SamplingParams) and params.temperature == 0.5
    params = _params(greedy, CHAT, {"messages": USER})
    assert isinstance(params, SamplingParams) and params.temperature == 0.0  # greedy without asking


def test_a_default_max_tokens_past_the_context_is_cut_to_it_not_refused() -> None:
    """vLLM takes min(max_model_len - prompt, the model's max_new_tokens); an asked-for max_tokens past the
    context stays a 400. The fake engine's max_model_len is 128."""
    async def main() -> tuple[int, int]:
        engine = FakeEngine()
        async with app_client(engine, sampling_defaults=SamplingDefaults(max_tokens=4096)) as client:
            reply = await client.post(CHAT, json={"messages": USER, "ignore_eos": True})
            asked = await client.post(CHAT, json={"messages": USER, "max_tokens": 4096})
            usage = reply.json()["usage"]
            assert reply.status_code == 200 and usage["prompt_tokens"] + usage["completion_tokens"] == 128
            return reply.status_code, asked.status_code
    assert run(main()) == (200, 400)
