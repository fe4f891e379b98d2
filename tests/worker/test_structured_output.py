"""Structured outputs in the worker: no request's grammar may raise into the step (it would stop the
engine for every request), a grammar that fails is reported (naming the field) besides allowing only
EOS, and a model whose EOS ids the tokenizer does not know still gets masks."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from conveyor.config import ModelConfig
from conveyor.sampling_params import GrammarKind, SamplingParams, StructuredOutput
from conveyor.worker.request_state import RequestState
from conveyor.worker.structured_output import GrammarVocab, StructuredOutputs


@functools.cache
def tokenizer_json() -> str:
    from conveyor.engine.model_files import tokenizer_path
    from conveyor.engine.tokenizer import Tokenizer

    return Tokenizer.from_path(tokenizer_path(ModelConfig())).backend.to_str()  # the embedded SmolLM2


def constrained(request_id: str, kind: GrammarKind, spec: str, field: str = "structured_outputs",
                min_tokens: int = 0) -> RequestState:
    params = SamplingParams(max_tokens=4, min_tokens=min_tokens, structured_output=StructuredOutput(kind, spec, field))
    return RequestState(request_id, [1, 2, 3], 3, [0], params, 0)


def allowed(outputs: StructuredOutputs, state: RequestState) -> set[int]:
    mask = outputs.mask([state], torch.device("cpu"))
    assert mask is not None
    words = mask.bitmask.numpy().view(np.uint32)[0]
    return {w * 32 + b for w in range(len(words)) for b in range(32) if words[w] >> b & 1}


def test_model_eos_outside_the_tokenizer_still_masks() -> None:
    """Random Qwen3 weights (vocabulary 151,936, EOS 151,645) served with SmolLM2's tokenizer (49,152):
    llguidance refuses such an EOS; the grammar then ends on the tokenizer's own EOS (H200, 2026-12-02:
    this request stopped the engine core)."""
    outputs = StructuredOutputs(GrammarVocab(tokenizer_json, 151_936, (151_645,)))
    ids = allowed(outputs, constrained("r", GrammarKind.CHOICE, '["yes", "no"]'))
    assert ids and max(ids) < 49_152 and len(ids) < 50  # a few prefixes of "yes" / "no", nothing else


def test_a_grammar_that_cannot_be_built_allows_only_eos(caplog: pytest.LogCaptureFixture) -> None:
    """The API server checks grammars first; should one still fail here, that request ends (EOS only) and
    the step goes on for the others."""
    outputs = StructuredOutputs(GrammarVocab(tokenizer_json, 49_152, (2,)))
    assert allowed(outputs, constrained("bad", GrammarKind.CHOICE, "not a JSON list", "guided_choice")) == {2}
    assert "could not be built" in caplog.text
    assert len(allowed(outputs, constrained("good", GrammarKind.CHOICE, '["yes", "no"]'))) < 50
    failures = outputs.take_failures()
    assert list(failures) == ["bad"] and failures["bad"].startswith("guided_choice: the output can no longer follow")
    assert outputs.take_failures() == {}  # reported once


def test_a_schema_with_no_possible_output_is_reported_not_a_silent_stop() -> None:
    """Issue 34: a JSON schema whose $ref loops compiles, but no token can start it; the worker allowed
    EOS and the client got 200 "stop" with "". The failure is now reported, naming the field."""
    outputs = StructuredOutputs(GrammarVocab(tokenizer_json, 49_152, (2,)))
    loop = '{"$ref": "#/definitions/a", "definitions": {"a": {"$ref": "#/definitions/a"}}}'
    assert allowed(outputs, constrained("loop", GrammarKind.JSON, loop, "guided_json")) == {2}
    message = outputs.take_failures()["loop"]
    assert message.startswith("guided_json: the output can no longer follow the grammar: no next token")


def test_a_token_the_grammar_refuses_under_min_tokens_is_the_requests_failure() -> None:
    """The grammar is complete at "no" and allows only EOS, which min_tokens forbids: every token is -inf and
    the sampler draws one the grammar refuses. The request asked for that: EOS only, and a 400 naming the field."""
    outputs = StructuredOutputs(GrammarVocab(tokenizer_json, 49_152, (2,)))
    state = constrained("r", GrammarKind.CHOICE, '["yes", "no"]', "guided_choice", min_tokens=3)
    assert len(allowed(outputs, state)) > 1
    assert outputs.take_failures() == {}
    state.token_ids.extend([4607, 1000])  # "no", then a token past the end of the grammar
    assert allowed(outputs, state) == {2}
    message = outputs.take_failures()["r"]
    assert message is not None
    assert message.startswith("guided_choice: the output can no longer follow the grammar: output token 1"), message


def test_a_token_the_mask_forbade_is_the_engines_fault(caplog: pytest.LogCaptureFixture) -> None:
    """Past min_tokens nothing in a request can lift the mask's -inf (a bias or penalty does not), so a
    sampled token the grammar refuses is the engine's fault: reported as None (an engine error, a 500,
    not a 400 blaming the request), with the reason logged as an error."""
    outputs = StructuredOutputs(GrammarVocab(tokenizer_json, 49_152, (2,)))
    state = constrained("r", GrammarKind.CHOICE, '["yes", "no"]', "guided_choice")
    state.token_ids.append(1000)  # some token that spells neither "yes" nor "no"
    assert allowed(outputs, state) == {2}
    assert outputs.take_failures() == {"r": None}
    assert any(r.levelname == "ERROR" and "output token 0: token 1000 refused" in r.message for r in caplog.records)


def test_llguidance_releases_that_take_one_eos_id(monkeypatch: pytest.MonkeyPatch) -> None:
    """llguidance < 1.7 takes `eos_token` as one int and raises TypeError on a list (H200, 2026-12-02:
    with 1.6.1 every structured request ended at once with EOS only). The first EOS id is used then."""
    from conveyor.worker import structured_output

    real = structured_output.LLTokenizer
    calls: list[object] = []

    def one_id_only(text: str, n_vocab: int | None = None, eos_token: object = None) -> object:
        calls.append(eos_token)
        if isinstance(eos_token, list):
            raise TypeError("argument 'eos_token': 'list' object cannot be interpreted as an integer")
        return real(text, n_vocab=n_vocab, eos_token=eos_token)

    monkeypatch.setattr(structured_output, "LLTokenizer", one_id_only)
    outputs = StructuredOutputs(GrammarVocab(tokenizer_json, 49_152, (2, 0)))
    ids = allowed(outputs, constrained("r", GrammarKind.CHOICE, '["yes", "no"]'))
    assert calls == [[2, 0], 2]
    assert ids and len(ids) < 50 and ids != {2}  # a real mask, not "EOS only"


def test_a_prepared_matcher_is_built_off_the_step_and_used_by_it() -> None:
    """`prepare` builds on the compile thread; the engine core schedules the request once `is_ready`, and
    its first mask uses that matcher (no build in the step). A dropped request's build is abandoned."""
    import time

    outputs = StructuredOutputs(GrammarVocab(tokenizer_json, 49_152, (2,)))
    state = constrained("r", GrammarKind.CHOICE, '["yes", "no"]', "guided_choice")
    assert state.sampling_params.structured_output is not None
    outputs.prepare("r", state.sampling_params.structured_output)
    deadline = time.monotonic() + 60
    while not outputs.is_ready("r"):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert 1 < len(allowed(outputs, state)) < 50
    assert outputs.is_ready("never-prepared")
    outputs.prepare("gone", state.sampling_params.structured_output)
    outputs.drop(["gone"])
    assert outputs.is_ready("gone")
    outputs.shutdown()


def test_choices_with_regex_metacharacters_match_exactly_themselves() -> None:
    """Choices compile as one regex of escaped literals: each choice, whatever it holds, is accepted
    whole, and nothing else is."""
    import json

    from llguidance import LLMatcher, LLTokenizer

    from conveyor.worker.grammar import grammar_of

    choices = ["a.b", "<x>", "(y)|z", "#~&-", "line\nbreak\ttab", "é ü 中", "back\\slash", "/slash/", '"q"',
               "[a-z]*", "a", "ab", "😀", "x{2}", "^$"]
    tokenizer = LLTokenizer(tokenizer_json(), n_vocab=49_152, eos_token=[2])
    grammar = grammar_of(StructuredOutput(GrammarKind.CHOICE, json.dumps(choices)))

    def accepts(text: str) -> bool:
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        tokens = tokenizer.tokenize_str(text)
        return matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting()

    assert all(accepts(choice) for choice in choices)
    assert not any(accepts(other) for other in ("a-b", "y", "xx", "[a-z]", "aab", "b"))


def test_the_vocabulary_is_indexed_once_before_serving_and_a_failure_fails_requests_alone(
        caplog: pytest.LogCaptureFixture) -> None:
    """A server indexes the vocabulary before it serves (indexing holds the GIL ~0.4 s: in a step it
    stalled every stream); a tokenizer llguidance cannot index must not stop the engine from starting."""
    reads: list[int] = []

    def counted() -> str:
        reads.append(1)
        return tokenizer_json()

    outputs = StructuredOutputs(GrammarVocab(counted, 49_152, (2,)))
    outputs.load_tokenizer()
    outputs.load_tokenizer()
    assert len(allowed(outputs, constrained("r", GrammarKind.CHOICE, '["yes", "no"]'))) < 50
    assert reads == [1]

    def unreadable() -> str:
        raise ValueError("no tokenizer.json here")

    broken = StructuredOutputs(GrammarVocab(unreadable, 49_152, (2,)))
    broken.load_tokenizer()  # logged, not raised
    assert "could not be indexed" in caplog.text
    assert allowed(broken, constrained("r", GrammarKind.CHOICE, '["yes"]', "guided_choice")) == {2}
    assert list(broken.take_failures()) == ["r"]


def test_the_front_ends_compiled_grammar_masks_as_the_constraint_it_came_from() -> None:
    """The API server sends the grammar it compiled (GrammarKind.LLGUIDANCE), so the engine process does no
    Python work to rebuild it; the masks are the same, and errors still name the request's field."""
    from conveyor.engine.grammar_check import compile_check

    source = StructuredOutput(GrammarKind.CHOICE, '["yes", "no", "maybe"]', "guided_choice")
    compiled = compile_check(source)
    assert (compiled.kind, compiled.field) == (GrammarKind.LLGUIDANCE, "guided_choice")
    outputs = StructuredOutputs(GrammarVocab(tokenizer_json, 49_152, (2,)))
    assert allowed(outputs, constrained("a", compiled.kind, compiled.spec)) == \
        allowed(outputs, constrained("b", source.kind, source.spec))


def test_the_eos_that_ends_a_completed_grammar_is_accepted_on_the_next_step() -> None:
    """Async scheduling (the CUDA default) builds step N+1's mask before the engine has seen step N's EOS,
    so the matcher consumes that EOS. A choice is complete at "no": llguidance has stopped there, and its
    `try_consume_tokens` refuses every token once stopped, EOS included; the request then ended as a 400
    "output token 1: token 2 refused" (H100, random Llama-3.1-8B weights, SmolLM2 tokenizer)."""
    outputs = StructuredOutputs(GrammarVocab(tokenizer_json, 128_256, (2,)))
    state = constrained("r", GrammarKind.CHOICE, '["yes", "no"]', "structured_outputs.choice")
    assert 2 not in allowed(outputs, state)  # EOS cannot start a choice
    state.token_ids.append(4607)  # "no": the grammar is complete
    assert allowed(outputs, state) == {2}
    state.token_ids.append(2)  # the EOS that step sampled, seen by the next step's mask
    assert allowed(outputs, state) == {2}  # still the end only (a request with ignore_eos goes on with it)
    state.token_ids.append(2)
    assert allowed(outputs, state) == {2}
    assert outputs.take_failures() == {}


def test_only_an_end_token_may_follow_the_end_token_of_a_completed_grammar() -> None:
    outputs = StructuredOutputs(GrammarVocab(tokenizer_json, 49_152, (2,)))
    state = constrained("r", GrammarKind.CHOICE, '["yes", "no"]', "guided_choice")
    state.token_ids.extend([4607, 2, 1000])  # "no", EOS, then some other token
    assert allowed(outputs, state) == {2}
    assert list(outputs.take_failures()) == ["r"]
