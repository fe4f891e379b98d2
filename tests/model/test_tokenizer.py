"""engine.tokenizer.Tokenizer rebuilt from the embedded GGUF equals transformers' GGUF tokenizer.

(Lives under tests/model because the model engineer owns the tokenizer; it imports no torch.)
"""

from __future__ import annotations

import json
import pathlib

import pytest

from conveyor.engine.tokenizer import Tokenizer, TokenizerError, read_gguf_metadata
from conveyor.model.loader import embedded_gguf_path

TEXTS = [
    "Hello, world!",
    "  leading spaces,\ttabs\n\nand newlines  ",
    "naïve café — 日本語のテキスト, Ελληνικά, emoji 🤖🎉👩‍👩‍👧",
    "<|im_start|>user\nhi there<|im_end|>\n",
    "In 2024, 12345 cats ate 3.14159 pies; x=1+2 it's I'm we'll",
    "def f(x):\n    return x ** 2  # comment",
]
MESSAGES = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye 👋"}],
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(embedded_gguf_path())


@pytest.fixture(scope="module")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    path = embedded_gguf_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tokenizer: Tokenizer, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_ids_equal_transformers_gguf_tokenizer(tokenizer: Tokenizer, hf_tokenizer, text: str) -> None:
    assert tokenizer.encode(text) == hf_tokenizer.encode(text)
    ids = tokenizer.encode(text)
    assert tokenizer.convert_ids_to_tokens(ids) == hf_tokenizer.convert_ids_to_tokens(ids)
    assert tokenizer.decode(ids, skip_special_tokens=True) == hf_tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
@pytest.mark.parametrize("messages", MESSAGES)
def test_chat_template_equals_transformers(tokenizer: Tokenizer, hf_tokenizer, messages) -> None:
    expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True) == expected


def test_special_tokens_and_sizes(tokenizer: Tokenizer) -> None:
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.vocab_size) == (1, 2, 49152)
    assert tokenizer.encode("<|im_end|>") == [2]  # control tokens stay whole
    assert {0, 1, 2} <= set(tokenizer.all_special_ids)
    assert tokenizer.decode([28, 2]) == ","  # special tokens skipped by default, as in vLLM
    assert tokenizer.decode([28, 2], skip_special_tokens=False) == ",<|im_end|>"
    assert tokenizer.encode("hi", add_special_tokens=True) == tokenizer.encode("hi", add_special_tokens=False)


def test_incremental_pieces_join_to_the_text(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("emoji 🤖 ok")
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert tokenizer.convert_tokens_to_string(tokens) == "emoji 🤖 ok"
    assert tokenizer.id_to_token(ids[0]) == tokens[0]


def test_metadata_reader(tmp_path: pathlib.Path) -> None:
    metadata = read_gguf_metadata(embedded_gguf_path())
    assert metadata["general.architecture"] == "llama" and len(metadata["tokenizer.ggml.tokens"]) == 49152
    bogus = tmp_path / "x.gguf"
    bogus.write_bytes(b"nope")
    with pytest.raises(TokenizerError, match="not a GGUF"):
        read_gguf_metadata(bogus)


def test_from_directory_with_tokenizer_json(tokenizer: Tokenizer, tmp_path: pathlib.Path) -> None:
    tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"}, "chat_template": "{{ messages[0]['content'] }}"}))
    loaded = Tokenizer.from_path(tmp_path)
    assert loaded.encode(TEXTS[2]) == tokenizer.encode(TEXTS[2])
    assert (loaded.bos_token_id, loaded.eos_token_id) == (1, 2)
    assert loaded.apply_chat_template([{"role": "user", "content": "x"}]) == "x"


def test_unknown_source_is_a_clear_error(tmp_path: pathlib.Path) -> None:
    with pytest.raises(TokenizerError, match="no tokenizer at"):
        Tokenizer.from_path(tmp_path)


@pytest.mark.parametrize(("name", "pieces"), [
    ("smollm", ["Ġ", "2", "0", "2", "4"]),  # digits one by one
    ("llama-bpe", ["Ġ", "202", "4"]),  # up to three digits
    ("qwen2", ["Ġ", "2", "0", "2", "4"]),
    ("gpt2", ["Ġ2024"]),
])
def test_gguf_pre_tokenizer_names(name: str, pieces: list[str]) -> None:
    from conveyor.engine.tokenizer import _pre_tokenizer

    assert [p for p, _ in _pre_tokenizer(name).pre_tokenize_str(" 2024")] == pieces


def test_unknown_gguf_pre_tokenizer_is_refused() -> None:
    from conveyor.engine.tokenizer import _pre_tokenizer

    with pytest.raises(TokenizerError, match="pre-tokenizer 'mystery' is not supported"):
        _pre_tokenizer("mystery")


def test_template_helpers_match_transformers(tokenizer: Tokenizer) -> None:
    source = "{{ messages | tojson }}|{{ strftime_now('%Y') | length }}"
    rendered = Tokenizer(tokenizer.backend, 1, 2, chat_template=source).apply_chat_template(
        [{"role": "user", "content": "<b>é</b>"}])
    assert rendered == '[{"role": "user", "content": "<b>é</b>"}]|4'
