"""The model's generation_config.json sets a real `conveyor serve`'s default sampling parameters, as in vLLM
(--generation-config auto), and `--generation-config vllm` turns them off.

A tiny random model whose generation_config.json says temperature 0 and max_new_tokens 5: served with the
default flags, two unseeded chat requests that set no temperature are greedy (identical text) and end at 5
tokens; with `--generation-config vllm` the same requests sample at vLLM's temperature 1.0 (their texts
differ: random weights give a nearly flat distribution) and may use the rest of the context."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator

import httpx2 as httpx
import pytest
from serve_process import Server, running_server

from conveyor.model.loader import embedded_gguf_path

pytestmark = pytest.mark.slow

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 49152, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}
"""SmolLM2's vocabulary on a tiny random model (served with the embedded SmolLM2 tokenizer)."""
BODY = {"messages": [{"role": "user", "content": "Say something."}], "ignore_eos": True}
"""No temperature, no max_tokens, no seed: the server's defaults decide; ignore_eos so the length shows."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    directory = tmp_path_factory.mktemp("greedy-by-default")
    (directory / "config.json").write_text(json.dumps(TINY_LLAMA))
    (directory / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 5}))
    return directory


def _serve(model_dir: pathlib.Path, *flags: str) -> Iterator[Server]:
    args = ["--model", str(model_dir), "--load-format", "dummy", "--tokenizer", str(embedded_gguf_path()),
            "--max-model-len", "64", "--max-num-seqs", "4", "--kv-cache-memory", "64MiB", *flags]
    with running_server(args) as server:
        yield server


def _answers(server: Server) -> list[tuple[str, int]]:
    replies = [httpx.post(server.url + "/v1/chat/completions", json=BODY, timeout=60) for _ in range(2)]
    assert all(reply.status_code == 200 for reply in replies), [reply.text for reply in replies]
    return [(r.json()["choices"][0]["message"]["content"], r.json()["usage"]["completion_tokens"]) for r in replies]


def test_the_models_generation_config_is_the_default(model_dir: pathlib.Path) -> None:
    for server in _serve(model_dir):
        (first, first_len), (second, second_len) = _answers(server)
        assert first == second and first_len == second_len == 5  # greedy, max_new_tokens
        assert any("Default sampling parameters have been overridden" in line for line in server.log)


def test_generation_config_vllm_keeps_vllms_defaults(model_dir: pathlib.Path) -> None:
    for server in _serve(model_dir, "--generation-config", "vllm"):
        (first, first_len), (second, second_len) = _answers(server)
        assert first != second  # sampled at temperature 1.0
        assert first_len == second_len > 5  # the rest of max_model_len
        assert not any("Default sampling parameters" in line for line in server.log)
        assert any("--generation-config=vllm" in line for line in server.log)  # a real flag: in the resolved config


def test_the_override_merges_over_the_file(model_dir: pathlib.Path) -> None:
    for server in _serve(model_dir, "--override-generation-config", '{"temperature": 1.0, "max_new_tokens": 3}'):
        (first, first_len), (second, second_len) = _answers(server)
        assert first != second and first_len == second_len == 3
