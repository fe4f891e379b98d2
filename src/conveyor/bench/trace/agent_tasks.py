"""Copy-heavy agent turns: requests whose right answer repeats text that is already in the prompt.

Agent and RAG traffic is full of them (quote the passage that says X, apply this edit to the code, fill
in this JSON) and they are where n-gram speculative decoding (prompt lookup) pays: the answer's next
tokens are a continuation of something in the context, so drafts copied from the prompt are accepted.
Chat traffic has nothing to copy and pays the drafts' cost. Each task returns the turn's input text,
its token count and the length of the copy it asks for, which becomes the turn's output_len, so a model
that does the task well spends its whole answer copying. The passages, programs and keys are natural
text from agent_corpus.py (a model copies prose and code; it paraphrases word-list soup), each with its
token count in SmolLM2's tokenizer, so the counts here are that tokenizer's up to a token or two at
the joins (tests/bench checks the sum against the tokenizer).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from conveyor.bench.trace.agent_corpus import CODE, FIELDS, Passage

SEPARATOR = "\n\n"
"""Between the system prompt, the documents, each document and a task's instruction and body."""
SEPARATOR_TOKENS = 2
"""Tokens of SEPARATOR between two words in SmolLM2's tokenizer."""
QUOTE_CUE_WORDS = 5
"""The quote task names its passage by this many first words."""
QUOTE = 'Quote exactly, word for word, the passage that begins with "{cue}".'
QUOTE_TOKENS = 15
"""Tokens of QUOTE around its cue."""
EDIT = "Rewrite this code with every + changed to - and nothing else changed:"
EDIT_TOKENS = 16
FILL = "Fill in every value of this JSON object from the documents and keep every key:"
FILL_TOKENS = 17
FILL_BRACES_TOKENS = 0
"""`{` and `}` around the entries, less the last entry's missing comma (they cancel)."""


class CopyTask(str, enum.Enum):
    QUOTE = "quote"
    EDIT = "edit"
    FILL = "fill"


@dataclass(frozen=True)
class TaskText:
    """One copy task: the turn's input, its length, and how many tokens the ideal answer copies."""

    text: str
    """The turn's input (instruction, then any body to copy)."""
    num_tokens: int
    """Tokens of text (SmolLM2's count, up to a token or two)."""
    copy_len: int
    """Tokens of the answer that repeat the prompt (the turn's output_len)."""


def quote_task(documents: list[Passage], rng: np.random.Generator) -> TaskText:
    """Quote one of the session's documents, found by its first words: the answer is that passage."""
    passage = documents[int(rng.integers(0, len(documents)))]
    words = passage.text.split()
    cue = " ".join(words[:QUOTE_CUE_WORDS])
    cue_tokens = round(passage.num_tokens * min(QUOTE_CUE_WORDS, len(words)) / len(words))
    return TaskText(text=QUOTE.format(cue=cue), num_tokens=QUOTE_TOKENS + cue_tokens, copy_len=passage.num_tokens)


def edit_task(rng: np.random.Generator) -> TaskText:
    """Rewrite a short program with one mechanical change (every `+` becomes `-`)."""
    program = CODE[int(rng.integers(0, len(CODE)))]
    return TaskText(text=EDIT + SEPARATOR + program.text, num_tokens=EDIT_TOKENS + SEPARATOR_TOKENS + program.num_tokens,
                    copy_len=program.num_tokens)


def fill_task(num_keys: int, rng: np.random.Generator) -> TaskText:
    """Fill in a JSON object whose keys are given: the answer repeats every key and the punctuation."""
    picked = rng.choice(len(FIELDS), size=min(num_keys, len(FIELDS)), replace=False)
    keys = [FIELDS[int(i)] for i in picked]
    body = "{" + ", ".join(f'"{key.text}": ""' for key in keys) + "}"
    body_tokens = FILL_BRACES_TOKENS + sum(key.num_tokens for key in keys)
    return TaskText(text=FILL + SEPARATOR + body, num_tokens=FILL_TOKENS + SEPARATOR_TOKENS + body_tokens,
                    copy_len=body_tokens + len(keys))


def copy_task(kind: CopyTask, documents: list[Passage], copy_len: int, rng: np.random.Generator) -> TaskText:
    """The task of the given kind; a fill task is sized to copy about copy_len tokens (the others copy
    one whole passage or program)."""
    if kind is CopyTask.QUOTE:
        return quote_task(documents, rng)
    if kind is CopyTask.EDIT:
        return edit_task(rng)
    return fill_task(max(1, copy_len // 5), rng)
