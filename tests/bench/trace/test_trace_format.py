"""Trace format (versioned JSONL) and the chat/long/agent generators."""

from __future__ import annotations

import json
import pathlib

import pytest

from conveyor.bench.trace.agent_corpus import CODE, INSTRUCTIONS, PROSE
from conveyor.bench.trace.agent_tasks import SEPARATOR
from conveyor.bench.trace.arrivals import ArrivalConfig
from conveyor.bench.trace.tokenizer_file import TokenCounter, load_tokenizer
from conveyor.bench.trace.trace_gen import AgentParams, TraceMakeConfig, make_mixed_trace
from conveyor.bench.trace.traces import TraceError, TraceRequest, dispatch_units, make_trace, read_trace, write_trace


def _cfg(**kw: object) -> TraceMakeConfig:
    return TraceMakeConfig(**kw)  # type: ignore[arg-type]


def test_roundtrip_and_version_is_content_hash(tmp_path: pathlib.Path) -> None:
    trace = make_mixed_trace(_cfg(num_requests=40, seed=3))
    path = tmp_path / "t.jsonl"
    write_trace(trace, path)
    assert read_trace(path) == trace
    header = json.loads(path.read_text().splitlines()[0])
    assert header["format"] == "conveyor-trace" and header["format_version"] == 1
    assert header["version"] == trace.header.version and header["seed"] == 3
    assert header["generator"]["config"]["chat"]["prompt_len_median"] == 64


def test_tampered_trace_is_rejected(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "t.jsonl"
    write_trace(make_mixed_trace(_cfg(num_requests=5)), path)
    lines = path.read_text().splitlines()
    lines[2] = lines[2].replace('"output_len":', '"output_len":1').replace(":1", ":1", 1)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError, match="edited"):
        read_trace(path)


def test_same_seed_same_version_other_seed_differs() -> None:
    a = make_mixed_trace(_cfg(num_requests=30, seed=1))
    assert a.header.version == make_mixed_trace(_cfg(num_requests=30, seed=1)).header.version
    assert a.header.version != make_mixed_trace(_cfg(num_requests=30, seed=2)).header.version


def test_bad_inputs_name_the_problem(tmp_path: pathlib.Path) -> None:
    with pytest.raises(TraceError, match="exactly one of prompt"):
        TraceRequest(request_id="a", request_class="chat", prompt_len=1, output_len=1)
    with pytest.raises(TraceError, match="unique"):
        r = TraceRequest(request_id="a", request_class="chat", prompt="x", prompt_len=1, output_len=1)
        make_trace([r, r], 0, {})
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"format": "other"}\n')
    with pytest.raises(TraceError, match="not a conveyor trace"):
        read_trace(bad)
    with pytest.raises(TraceError, match="does not exist"):
        read_trace(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="--mix"):
        make_mixed_trace(_cfg(mix={"chat": 1.0, "video": 1.0}))
    with pytest.raises(ValueError, match="--duration needs a finite --rate"):
        make_mixed_trace(_cfg(num_requests=None, duration_s=5.0))


def test_lengths_are_word_counts_and_classes_differ() -> None:
    trace = make_mixed_trace(_cfg(num_requests=200, seed=0))
    by_class: dict[str, list[TraceRequest]] = {}
    for r in trace.requests:  # word-list text: n words are n tokens (the agent class's prose: below)
        assert r.prompt is not None
        assert r.request_class == "agent" or len(r.prompt.split()) == r.prompt_len
        by_class.setdefault(r.request_class, []).append(r)
    assert set(by_class) == {"chat", "long", "agent"}
    assert 0.45 < len(by_class["chat"]) / 200 < 0.75  # mix 0.6
    assert max(r.prompt_len for r in by_class["chat"]) <= 512
    assert min(r.prompt_len for r in by_class["long"]) >= 1500


def test_agent_sessions_share_the_system_prompt_copy_from_the_prompt_and_some_cancel() -> None:
    params = AgentParams(cancel_fraction=0.5)
    trace = make_mixed_trace(_cfg(mix={"agent": 1.0}, num_requests=80, seed=4, agent=params))
    sessions = dispatch_units(trace.requests)
    assert len(sessions) < 80 and any(len(s) >= 3 for s in sessions)  # multi-turn, 1 + Poisson(2) turns
    firsts = [s[0] for s in sessions]
    system = str(firsts[0].prompt).split(SEPARATOR)[0]
    assert system.startswith(INSTRUCTIONS[0].text)  # the instructions, in order
    documents = set()
    for first in firsts:  # one system prompt for all agent traffic, then the session's own documents
        assert first.turn == 0 and first.prefix_group == "agent-system"
        assert first.shared_prefix_len == 256 and str(first.prompt).startswith(system + SEPARATOR)
        documents.add(str(first.prompt)[len(system):].rsplit(SEPARATOR, 1)[0])
    assert len(documents) == len(firsts)  # passages in each session's own order
    later = [r for s in sessions for r in s[1:]]
    assert all(r.think_time_s is not None and r.prompt_len < 200 for r in later)  # only the new input
    quotes = [r for r in trace.requests if "Quote exactly" in str(r.prompt)]
    edits = [r for r in trace.requests if "Rewrite this code" in str(r.prompt)]
    fills = [r for r in trace.requests if "Fill in every value" in str(r.prompt)]
    assert quotes and edits and fills and len(quotes) + len(edits) + len(fills) < 80
    for r in quotes:  # the passage to quote is one of the session's documents, found by its first words
        cue = str(r.prompt).split('begins with "')[1].split('"')[0]
        context = str(next(s for s in sessions if r in s)[0].prompt)
        passage = next(p for p in PROSE if p.text.startswith(cue))
        assert cue in context and (r.output_len == passage.num_tokens) == (passage.text in context)  # or cut
    for r in edits:  # the whole program is in the request, and the answer is as long as the program
        assert any(c.text in str(r.prompt) and r.output_len == c.num_tokens for c in CODE)
    by_s = [r for r in trace.requests if r.cancel_after_s is not None]
    by_tokens = [r for r in trace.requests if r.cancel_after_tokens is not None]
    assert by_s and by_tokens and len(by_s) + len(by_tokens) < 80


def test_agent_prompt_lengths_are_smollm2_token_counts() -> None:
    """The corpus's stored counts are SmolLM2's; a whole agent prompt is within 2 tokens (the joins)."""
    counter = _smollm2_tokenizer()

    def count(text: str) -> int:
        return len(counter.encode(text))

    for passage in (*PROSE, *INSTRUCTIONS, *CODE):
        assert count(passage.text) == passage.num_tokens, passage.text[:40]
    trace = make_mixed_trace(_cfg(mix={"agent": 1.0}, num_requests=120, seed=9))
    errors = [count(str(r.prompt)) - r.prompt_len for r in trace.requests]
    assert max(abs(e) for e in errors) <= 3 and abs(sum(errors)) / len(errors) < 1.0, errors


def _smollm2_tokenizer() -> TokenCounter:
    pytest.importorskip("tokenizers")
    from conveyor.model.loader import ModelNotFoundError, embedded_gguf_path

    try:
        path = embedded_gguf_path()
    except ModelNotFoundError as exc:  # the embedded model's package is optional outside CI
        pytest.skip(str(exc))
    return load_tokenizer(str(path))


def test_stamped_arrivals_rate_duration_and_sessions() -> None:
    trace = make_mixed_trace(_cfg(num_requests=None, duration_s=60.0, seed=1,
                                  arrival=ArrivalConfig(request_rate=5.0, seed=1)))
    firsts = [u[0] for u in dispatch_units(trace.requests)]
    stamps = [r.arrival_s for r in firsts]
    assert all(s is not None for s in stamps) and stamps == sorted(stamps)  # type: ignore[type-var]
    assert 200 < len(trace.requests) < 400  # ~300 arrivals in 60 s at 5 req/s
    later = [r for r in trace.requests if r.turn]
    assert later and all(r.arrival_s is None for r in later)  # a later turn follows its answer, not the clock
    position = {r.request_id: i for i, r in enumerate(trace.requests)}
    for unit in dispatch_units(trace.requests):  # turns are written in order
        assert [position[r.request_id] for r in unit] == sorted(position[r.request_id] for r in unit)


def test_request_lines_are_type_checked_field_by_field() -> None:
    from conveyor.bench.trace import traces

    assert set(traces._FIELD_TYPES) == set(TraceRequest.__dataclass_fields__)  # a new field needs its JSON type
    good = {"request_id": "a", "request_class": "chat", "prompt_len": 2, "output_len": 3, "prompt": "x y"}
    assert TraceRequest.from_dict(dict(good, arrival_s=1)).arrival_s == 1
    for bad, message in (({"prompt_len": "2"}, "field prompt_len must be int"),
                         ({"request_id": None}, "field request_id must be str"),
                         ({"prompt": None, "prompt_token_ids": [1, "2"]}, "field prompt_token_ids must be list")):
        with pytest.raises(TraceError, match=message):
            TraceRequest.from_dict(dict(good, **bad))
