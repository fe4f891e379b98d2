"""Structured-output constraints as llguidance grammars (no torch: the API side validates with it too).

llguidance (vLLM's `guidance` backend) compiles JSON schemas, regular expressions and Lark grammars
into a matcher that, given the tokens so far, says which tokens may come next. Choices become one
regular expression, an alternation of escaped literals: a single lexeme, where a Lark alternation makes
a grammar symbol per choice (100,000 choices took 6 s to check, then failed to build a matcher at
llguidance's 65,535-symbol limit; as one regex they check in 1 s and build in 0.5 s). A GBNF grammar
(llama.cpp's, `::=`) is converted to Lark first.
Why llguidance and not xgrammar: its wheel has no dependencies (xgrammar's pulls triton, 286 MB, and
transformers, and would turn conveyor's HAS_TRITON on in CPU installs) and it compiles lazily (a
schema's matcher is ready in about 1 ms; the tokenizer's index, once per process, takes about 0.4 s).
"""

from __future__ import annotations

import json

from llguidance import LLMatcher
from llguidance.gbnf_to_lark import gbnf_to_lark

from conveyor.sampling_params import GrammarKind, StructuredOutput


class GrammarError(ValueError):
    """The constraint does not compile; the message says why (for a 400 naming the field)."""


def grammar_of(constraint: StructuredOutput) -> str:
    """The llguidance grammar (serialized) for a constraint; GrammarError if it cannot be built."""
    kind, spec = constraint.kind, constraint.spec
    try:
        if kind is GrammarKind.LLGUIDANCE:
            return spec
        if kind is GrammarKind.JSON:
            return LLMatcher.grammar_from_json_schema(spec)
        if kind is GrammarKind.JSON_OBJECT:
            return LLMatcher.grammar_from_json_schema({"type": "object"})
        if kind is GrammarKind.REGEX:
            return LLMatcher.grammar_from_regex(spec)
        if kind is GrammarKind.CHOICE:
            choices = json.loads(spec)
            return LLMatcher.grammar_from_regex("(" + "|".join(_literal(c) for c in choices) + ")")
        lark = gbnf_to_lark(spec) if "::=" in spec else spec
        return LLMatcher.grammar_from_lark(lark)
    except Exception as error:  # noqa: BLE001 - GbnfToLarkError derives from Exception alone
        raise GrammarError(one_line(str(error)) or type(error).__name__) from None


_ESCAPES = {code: f"\\x{{{code:X}}}" for code in range(128) if not (chr(code).isalnum() or chr(code) in " _")}
"""Every ASCII character but letters, digits, space and `_` -> `\\x{HEX}`, which the regex syntax reads as
that character whatever it is: no metacharacter, `/` delimiter or newline survives to be misread. The
regex syntax's metacharacters are all ASCII, so other characters stay as they are."""


def _literal(text: str) -> str:
    """`text` as a regex matching exactly it (one `str.translate`: 100,000 choices in milliseconds, where
    a Python loop per character held the GIL for 130 ms)."""
    return text.translate(_ESCAPES)


def one_line(message: str, limit: int = 300) -> str:
    """The message on one line, without the backtrace or parser state llguidance may append (a 400's
    message is one line), cut to `limit` characters (a huge grammar may be quoted in it)."""
    for marker in ("<backtrace>", "<state>"):
        message = message.split(marker, 1)[0]
    text = " ".join(message.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check_grammar(constraint: StructuredOutput) -> str:
    """The constraint's llguidance grammar (serialized); GrammarError unless it compiles (checked once,
    before the engine sees it)."""
    if constraint.kind is GrammarKind.CHOICE:
        choices = json.loads(constraint.spec)
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise GrammarError("choice must be a non-empty list of non-empty strings")
    grammar = grammar_of(constraint)
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(one_line(error))
    return grammar
