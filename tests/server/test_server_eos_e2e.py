"""A completed grammar ends its request on a real `conveyor serve`, even where the model's EOS lies outside
the tokenizer's vocabulary: random weights in the Llama-3.1-8B EOS layout (config eos 128001, 128,256
logits) served with the embedded SmolLM2 tokenizer (49,152 tokens, EOS 2).

Before the fix the engine stopped on config.json's first id only (128001), while the grammar, which
llguidance could not end on 128001, ended on the tokenizer's own EOS: the sampler drew it, the request
went on, and the next step's mask refused it (HTTP 400 `token 0 refused`, seen on an H100). Now the
primary EOS is the tokenizer's, and the grammar ends on exactly the EOS ids the engine stops on.

Under async scheduling (the CUDA default) the step after the one that drew that EOS builds its mask
before the engine has ended the request, so the matcher, which llguidance had stopped at "yes" or "no",
saw the EOS and refused it (HTTP 400 `output token 1: token 2 refused`, H100): the server runs both ways.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx2 as httpx
import pytest
from serve_process import Server, running_server

from conveyor.model.loader import embedded_gguf_path

pytestmark = pytest.mark.slow

FOREIGN_EOS_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128256, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001,
}
"""Llama-3.1-8B's vocabulary and EOS on a tiny random model."""


@pytest.fixture(scope="module", params=["--no-async-scheduling", "--async-scheduling"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model_dir = tmp_path_factory.mktemp("foreign-eos-llama")
    (model_dir / "config.json").write_text(json.dumps(FOREIGN_EOS_LLAMA))
    args = ["--model", str(model_dir), "--load-format", "dummy", "--tokenizer", str(embedded_gguf_path()),
            "--max-model-len", "64", "--max-num-seqs", "4", "--kv-cache-memory", "64MiB", request.param]
    with running_server(args) as server:
        yield server


def test_a_completed_choice_grammar_stops_the_request(server: Server) -> None:
    body = {"prompt": "Yes or no?", "max_tokens": 8, "temperature": 1.0,
            "structured_outputs": {"choice": ["yes", "no"]}}
    for seed in range(4):  # the random weights pick a different choice now and then: each must end cleanly
        response = httpx.post(server.url + "/v1/completions", json={**body, "seed": seed}, timeout=60)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["text"] in {"yes", "no"} and choice["finish_reason"] == "stop", choice
        assert choice.get("stop_reason") is None  # the tokenizer's EOS is the primary one


def test_the_model_eos_outside_the_tokenizer_is_named_in_no_warning(server: Server) -> None:
    """The grammar no longer offers llguidance an id it refuses, so it never falls back to its own guess."""
    assert not any("out of range" in line for line in server.log), "".join(server.log)
