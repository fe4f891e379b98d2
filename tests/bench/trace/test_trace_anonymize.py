"""import + --anonymize: lengths and prefix sharing kept exactly, no original word leaked (property)."""

from __future__ import annotations

import json
import pathlib
import tempfile

from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.bench.trace.trace_import import ImportConfig, import_trace
from conveyor.bench.trace.traces import TraceError

ORIGINAL_WORDS = ["the", "patient", "secret", "alice", "bob", "password", "42", "x", "which", "account"]
words = st.lists(st.sampled_from(ORIGINAL_WORDS), min_size=1, max_size=12)


def _common_prefix(a: list[str], b: list[str]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _write_log(path: pathlib.Path, prompts: list[list[str]]) -> None:
    with path.open("w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"timestamp": 100.0 + i, "prompt": " ".join(p), "output_tokens": 1 + i % 7,
                                "session_id": f"user-{i % 3}"}) + "\n")


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.lists(words, min_size=1, max_size=15), st.integers(0, 5))
def test_anonymize_keeps_structure_and_leaks_nothing(prompts: list[list[str]], seed: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        log = pathlib.Path(d) / "log.jsonl"
        _write_log(log, prompts)
        trace = import_trace(ImportConfig(log_path=str(log), anonymize=True, seed=seed))
    out = [str(r.prompt).split() for r in trace.requests]
    assert [len(o) for o in out] == [len(p) for p in prompts]
    for i in range(len(prompts)):
        for j in range(len(prompts)):
            assert _common_prefix(out[i], out[j]) == _common_prefix(prompts[i], prompts[j])
    leaked = {w for o in out for w in o} & set(ORIGINAL_WORDS)
    assert not leaked
    text = "\n".join(r.to_json() for r in trace.requests)
    assert "user-" not in text and "secret" not in text
    assert [r.output_len for r in trace.requests] == [1 + i % 7 for i in range(len(prompts))]


def test_messages_keep_roles_and_per_message_lengths(tmp_path: pathlib.Path) -> None:
    log = tmp_path / "log.jsonl"
    msgs = [{"role": "system", "content": "you are helpful"}, {"role": "user", "content": "my secret is swordfish"}]
    other = [msgs[0], {"role": "user", "content": "my name is alice"}]
    log.write_text("\n".join(json.dumps({"timestamp": "2026-01-01T00:00:0%dZ" % i, "messages": m,
                                         "completion_tokens": 5, "class": "support"})
                             for i, m in enumerate([msgs, other])) + "\n")
    trace = import_trace(ImportConfig(log_path=str(log), anonymize=True))
    a, b = trace.requests
    assert a.messages is not None and b.messages is not None
    assert [m["role"] for m in a.messages] == ["system", "user"]
    assert [len(m["content"].split()) for m in a.messages] == [3, 4]
    assert a.messages[0] == b.messages[0] and a.messages[1]["content"].split()[0] == b.messages[1]["content"].split()[0]
    assert a.messages[1]["content"].split()[1] != b.messages[1]["content"].split()[1]
    assert a.shared_prefix_len == b.shared_prefix_len == 4 and a.prefix_group == b.prefix_group
    assert b.arrival_s == 1.0 and a.request_class == "support"
    assert "swordfish" not in a.to_json() + b.to_json()


def test_import_without_anonymize_keeps_text_and_counts(tmp_path: pathlib.Path) -> None:
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps({"timestamp": 5, "prompt": "hello there", "output_tokens": 3, "prompt_tokens": 4,
                               "request_id": "abc"}) + "\n")
    (r,) = import_trace(ImportConfig(log_path=str(log))).requests
    assert (r.prompt, r.prompt_len, r.output_len, r.request_id, r.arrival_s) == ("hello there", 4, 3, "abc", 0.0)


def test_bad_log_lines_name_file_and_line(tmp_path: pathlib.Path) -> None:
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps({"timestamp": 1, "prompt": "x", "output_tokens": 1}) + "\n"
                   + json.dumps({"timestamp": 2, "prompt": "y"}) + "\n")
    try:
        import_trace(ImportConfig(log_path=str(log)))
    except TraceError as exc:
        assert "log.jsonl:2" in str(exc) and "output token count" in str(exc)
    else:
        raise AssertionError("a line without an output count must be rejected")
