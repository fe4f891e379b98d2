"""Copy-heavy agent turns: requests whose right answer repeats text that is already in the prompt.

Agent and RAG traffic is full of them (quote the passage that says X, apply this edit to the code, fill
in this JSON) and they are where n-gram speculative decoding (prompt lookup) pays: the answer's next
tokens are a continuation of something in the context, so drafts copied from the prompt are accepted.
Chat traffic has nothing to copy and pays the drafts' cost. Each task here returns the turn's input
words and the length of the copy it asks for, which becomes the turn's output_len, so a model that does
the task well spends its whole answer copying. The instruction words are plain English (mostly one
token each); the code and JSON bodies are built from the word list with spaced punctuation, so the
word count stays close to the token count (docs/trace-format.md says by how much).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from conveyor.bench.wordlist import WORDS


class CopyTask(str, enum.Enum):
    QUOTE = "quote"
    EDIT = "edit"
    FILL = "fill"


@dataclass(frozen=True)
class TaskText:
    """One copy task: the words of the turn's input, and how many tokens the ideal answer copies."""

    words: list[str]
    """The turn's input, whitespace-split (instruction + any body to copy)."""
    copy_len: int
    """Tokens of the answer that repeat the prompt (the turn's output_len)."""


def _words(rng: np.random.Generator, n: int) -> list[str]:
    return [WORDS[int(i)] for i in rng.integers(0, len(WORDS), size=n)]


def quote_task(context: list[str], copy_len: int, rng: np.random.Generator) -> TaskText:
    """Quote a passage of the documents already in the context, found by its first words."""
    copy_len = max(4, min(copy_len, len(context)))
    start = int(rng.integers(0, len(context) - copy_len + 1))
    cue = " ".join(context[start:start + 4])
    words = f'Quote exactly, word for word, the {copy_len} words of the documents that begin with "{cue}"'.split()
    return TaskText(words=words, copy_len=copy_len)


def edit_task(num_lines: int, rng: np.random.Generator) -> TaskText:
    """Rewrite a short program with one mechanical change (every `+` becomes `-`)."""
    lines = []
    for _ in range(num_lines):
        a, b, c = _words(rng, 3)
        lines.append(f"{a} = {b} + {c}")
    body = " ".join(lines).split()
    words = "Rewrite this code with every + changed to - and nothing else changed :".split() + body
    return TaskText(words=words, copy_len=len(body))


def fill_task(num_keys: int, rng: np.random.Generator) -> TaskText:
    """Fill in a JSON object whose keys are given: the answer repeats every key and the punctuation."""
    keys = _words(rng, num_keys)
    body = ["{"] + [piece for k in keys for piece in (f'"{k}"', ":", '""', ",")][:-1] + ["}"]
    words = "Fill in every value of this JSON object and keep every key :".split() + body
    return TaskText(words=words, copy_len=len(body) + num_keys)


def copy_task(kind: CopyTask, context: list[str], copy_len: int, rng: np.random.Generator) -> TaskText:
    """The task of the given kind, sized to copy about copy_len tokens."""
    if kind is CopyTask.QUOTE:
        return quote_task(context, copy_len, rng)
    if kind is CopyTask.EDIT:
        return edit_task(max(1, copy_len // 5), rng)
    return fill_task(max(1, copy_len // 5), rng)
