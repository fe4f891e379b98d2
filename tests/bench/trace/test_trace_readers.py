"""`conveyor trace import --format ...` on the small files in fixtures/readers: what each reader keeps, and
that --anonymize keeps its guarantees whatever the format (lengths, shared prefixes, no original word)."""

from __future__ import annotations

import json
import pathlib

import pytest

from conveyor.bench.trace.tokenizer_file import load_tokenizer
from conveyor.bench.trace.trace_import import ImportConfig, ImportFormat, Turns, import_trace
from conveyor.bench.trace.trace_synthetic import RandomParams
from conveyor.bench.trace.traces import Trace, TraceError, TraceRequest, dispatch_units
from conveyor.cli import main

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures" / "readers"
TOKENIZER = str(FIXTURES / "tokenizer.json")  # WordLevel, prepends <s>: count = words + 1


def _import(fmt: str, name: str | None, **kw: object) -> Trace:
    path = None if name is None else str(FIXTURES / name)
    return import_trace(ImportConfig(log_path=path, format=ImportFormat(fmt), **kw))  # type: ignore[arg-type]


def _words(r: TraceRequest) -> list[str]:
    if r.prompt is not None:
        return r.prompt.split()
    return [f"{i}:{w}" for i, m in enumerate(r.messages or []) for w in m["content"].split()]


def _common(a: list[str], b: list[str]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _source_words(name: str) -> set[str]:
    text = (FIXTURES / name).read_text()
    return {w.strip('",.:{}[]').lower() for w in text.split()} - {""}


@pytest.mark.parametrize(("fmt", "name", "kw"), [
    ("sharegpt", "sharegpt.json", {}), ("sharegpt", "sharegpt.json", {"turns": Turns.ALL}),
    ("hf", "alpaca.jsonl", {}), ("hf", "chat_messages.json", {}), ("openai-log", "openai_log.jsonl", {}),
])
def test_anonymize_keeps_lengths_and_shared_prefixes_and_leaks_no_word(fmt: str, name: str, kw: dict) -> None:
    plain, anon = _import(fmt, name, **kw), _import(fmt, name, anonymize=True, seed=3, **kw)
    a, b = [_words(r) for r in plain.requests], [_words(r) for r in anon.requests]
    assert [len(x) for x in a] == [len(x) for x in b]
    assert [r.output_len for r in plain.requests] == [r.output_len for r in anon.requests]
    for i in range(len(a)):
        for j in range(len(a)):
            assert _common(a[i], a[j]) == _common(b[i], b[j])
    text = " ".join(r.to_json() for r in anon.requests).lower()
    leaked = {w for w in _source_words(name) if len(w) > 3 and f" {w} " in f" {' '.join(' '.join(x) for x in b)} "}
    assert not leaked and "secret" not in text and "customer-7" not in text and "conv-a" not in text


def test_sharegpt_first_turn_as_vllm_samples_it() -> None:
    trace = _import("sharegpt", "sharegpt.json")
    assert len(trace.requests) == 2  # conv-b has one message, conv-d's "hi" is under vLLM's 4-token minimum
    a, c = trace.requests
    assert a.prompt == "please explain how the secret recipe for apple pie works in detail"
    assert a.output_len == 13  # words of the reply (tokens with --tokenizer)
    assert c.messages == [{"role": "system", "content": "you are terse"},
                          {"role": "user", "content": "please explain how the secret handshake of the club goes"}]
    assert a.arrival_s is None and trace.header.generator["format"] == "sharegpt"


def test_sharegpt_all_turns_are_sessions() -> None:
    trace = _import("sharegpt", "sharegpt.json", turns=Turns.ALL)
    units = dispatch_units(trace.requests)
    assert [[(r.session_id, r.turn) for r in u] for u in units] == [
        [("conv-a", 0), ("conv-a", 1)], [("conv-c", 0)], [("conv-d", 0)]]
    assert units[0][1].prompt == "and how long should it bake" and units[0][1].output_len == 8


def test_hf_jsonl_and_parquet_read_the_same_rows() -> None:
    pytest.importorskip("pyarrow")
    jsonl, parquet = _import("hf", "alpaca.jsonl"), _import("hf", "alpaca.parquet")
    assert [r.to_json() for r in jsonl.requests] == [
        r.to_json().replace("alpaca.parquet", "alpaca.jsonl") for r in parquet.requests]
    first = jsonl.requests[0]
    assert first.prompt == "Summarize the private memo of alice\nalice wrote that the merger closes friday"
    assert first.output_len == 7 and jsonl.requests[1].prompt == "Summarize the private memo of bob"


def test_hf_columns_and_fixed_lengths(tmp_path: pathlib.Path) -> None:
    trace = _import("hf", "alpaca.jsonl", prompt_column="output", output_len=5)
    assert trace.requests[0].prompt == "the merger closes on friday per alice" and trace.requests[0].output_len == 5
    with pytest.raises(TraceError, match="no column 'nope'"):
        _import("hf", "alpaca.jsonl", prompt_column="nope", output_len=5)
    texts = tmp_path / "texts.jsonl"
    texts.write_text(json.dumps({"text": "a prompt with no answer"}) + "\n")
    with pytest.raises(TraceError, match="--output-len"):
        import_trace(ImportConfig(log_path=str(texts), format=ImportFormat.HF))
    assert import_trace(ImportConfig(log_path=str(texts), format=ImportFormat.HF, output_len=9)).requests[0].output_len == 9


def test_openai_log_replays_timestamps_usage_and_users() -> None:
    trace = _import("openai-log", "openai_log.jsonl")
    assert [r.arrival_s for r in trace.requests] == [0.0, 1.0, 2.5]  # sorted by timestamp
    assert [r.output_len for r in trace.requests] == [17, 8, 40]  # usage, else max_(completion_)tokens
    first, note, card = trace.requests
    assert first.prompt_len == 21 and first.session_id == "customer-7" and first.request_id == "cmpl-1"
    assert note.prompt == "complete this private note: the vault code is"
    assert first.shared_prefix_len == card.shared_prefix_len == 6  # the system prompt + "my"


def test_mooncake_blocks_are_really_shared() -> None:
    trace = _import("mooncake", "mooncake.jsonl", block_size=16)
    r0, r700, r1500, r3000, r3200 = trace.requests  # sorted by timestamp (ms)
    assert [r.arrival_s for r in trace.requests] == [0.0, 0.7, 1.5, 3.0, 3.2]
    assert [r.prompt_len for r in trace.requests] == [40, 20, 36, 12, 50]
    w = {k: str(r.prompt).split() for k, r in zip(("a", "b", "c", "d", "e"), trace.requests)}
    assert all(len(w[k]) == r.prompt_len for k, r in zip(w, trace.requests))
    assert w["a"][:32] == w["c"][:32] == w["e"][:32] and w["a"][32:36] != w["c"][32:36]  # blocks 0, 1 shared
    assert w["b"][:16] == w["a"][:16] and w["b"][16:20] != w["a"][16:20]  # block 0 shared, then block 4
    assert [r.shared_prefix_len for r in trace.requests] == [32, 16, 32, 0, 32]
    assert r0.prefix_group == r1500.prefix_group == r3200.prefix_group != r700.prefix_group and r3000.prefix_group is None
    exact = _import("mooncake", "mooncake.jsonl", block_size=16, tokenizer_path=TOKENIZER)
    ids = [r.prompt_token_ids or [] for r in exact.requests]
    assert [len(x) for x in ids] == [40, 20, 36, 12, 50] and ids[0][:32] == ids[2][:32]


def test_mooncake_bad_line_names_it(tmp_path: pathlib.Path) -> None:
    bad = tmp_path / "m.jsonl"
    bad.write_text(json.dumps({"timestamp": 0, "input_length": 3, "hash_ids": []}) + "\n")
    with pytest.raises(TraceError, match="m.jsonl:1.*output_length"):
        import_trace(ImportConfig(log_path=str(bad), format=ImportFormat.MOONCAKE))


def test_random_as_vllm_draws_it() -> None:
    params = RandomParams(input_len=20, output_len=8, range_ratio=0.5, prefix_len=4)
    trace = _import("random", None, num_requests=30, random=params, seed=2)
    assert trace.header.version == _import("random", None, num_requests=30, random=params, seed=2).header.version
    words = [str(r.prompt).split() for r in trace.requests]
    assert all(w[:4] == words[0][:4] for w in words) and all(r.shared_prefix_len == 4 for r in trace.requests)
    assert all(4 + 10 <= r.prompt_len <= 4 + 30 and 4 <= r.output_len <= 12 for r in trace.requests)
    assert len({r.prompt_len for r in trace.requests}) > 5


def test_random_with_a_tokenizer_has_exact_lengths() -> None:
    counter = load_tokenizer(TOKENIZER)
    trace = _import("random", None, num_requests=10, random=RandomParams(input_len=12, output_len=4),
                    tokenizer_path=TOKENIZER)
    for r in trace.requests:
        assert r.prompt_len == counter.count(str(r.prompt)) == 12  # 11 body tokens + <s>, as vLLM aims


def test_tokenizer_counts_prompts_and_answers() -> None:
    trace = _import("sharegpt", "sharegpt.json", tokenizer_path=TOKENIZER)
    a = trace.requests[0]
    assert a.prompt_len == len(str(a.prompt).split()) + 1 and a.output_len == 13 + 1
    assert trace.header.generator["prompt_len"].startswith("tokenizer ")


def test_gguf_tokenizer_matches_the_engines() -> None:
    loader = pytest.importorskip("conveyor.model.loader")
    try:
        gguf = loader.embedded_gguf_path()
    except loader.ModelNotFoundError:
        pytest.skip("the embedded model is not installed")
    from conveyor.engine.tokenizer import Tokenizer

    text = "Quote exactly, word for word: the 42 passages of 2024!"
    assert load_tokenizer(str(gguf)).count(text) == len(Tokenizer.from_path(gguf).encode(text))


@pytest.mark.parametrize(("argv", "message"), [
    (["trace", "import", "--out", "x"], "input file"),
    (["trace", "import", str(FIXTURES / "sharegpt.json"), "--format", "sharegpt", "--tokenizer", "/nope",
      "--out", "x"], "--tokenizer"),
    (["trace", "import", "--format", "random", "--random-range-ratio", "1.5", "--out", "x"], "--random-range-ratio"),
])
def test_cli_errors_name_the_flag(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_cli_random_import(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "r.jsonl"
    assert main(["trace", "import", "--format", "random", "--num-requests", "4", "--random-input-len", "16",
                 "--out", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert len(lines) == 5 and json.loads(lines[1])["prompt_len"] == 16


def test_mooncake_non_numeric_field_is_named(tmp_path: pathlib.Path) -> None:
    bad = tmp_path / "m.jsonl"
    bad.write_text(json.dumps({"timestamp": 0, "input_length": "many", "output_length": 2, "hash_ids": [1]}) + "\n")
    with pytest.raises(TraceError, match="m.jsonl:1: input_length must be a number"):
        import_trace(ImportConfig(log_path=str(bad), format=ImportFormat.MOONCAKE))


def test_rows_are_checked_when_read_and_only_the_first_n_are_read(tmp_path: pathlib.Path) -> None:
    log = tmp_path / "o.jsonl"
    good = {"timestamp": 1, "request": {"prompt": "a b c", "max_tokens": 3}}
    log.write_text(json.dumps(good) + "\n" + json.dumps({"timestamp": 2, "request": "not an object"}) + "\n")
    with pytest.raises(TraceError, match="o.jsonl:2: needs a 'request' object"):
        import_trace(ImportConfig(log_path=str(log), format=ImportFormat.OPENAI_LOG))
    (r,) = import_trace(ImportConfig(log_path=str(log), format=ImportFormat.OPENAI_LOG, num_requests=1)).requests
    assert (r.prompt, r.output_len, r.arrival_s) == ("a b c", 3, 0.0)
