"""Tokenization and chat templates off the event loop, in two lanes so a huge prompt never delays a small one.

The `tokenizers` library releases the GIL while it encodes, so a 4 MB prompt tokenized on a worker
thread leaves the event loop free to serve every other connection (only building the Python list of
ids holds the GIL, for a fraction of the time). One lane is not enough: a client looping 4 MB
/tokenize calls would keep a shared pool busy and every normal request would queue behind it for
seconds. So texts up to `SMALL_TEXT_CHARS` go to their own single-thread executor, longer ones to a
separate pool: the cost of a huge text falls on the lane of huge texts. That lane also runs at a lower
CPU priority (`LARGE_TEXT_NICE`; Linux nice values are per thread): on a machine with few cores, seconds
of tokenization would otherwise take a core from the engine process's step loop and every stream
would slow down with it.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, TypeVar

T = TypeVar("T")

SMALL_TEXT_CHARS = 32 * 1024
"""Texts at most this long take the fast lane (a few milliseconds of tokenization at most)."""
NUM_LARGE_TEXT_THREADS = 2
"""Worker threads for longer texts."""
LARGE_TEXT_NICE = 10
"""How much lower the large-text lane's CPU priority is (os.setpriority; raising nice needs no privilege)."""


def lower_this_threads_priority() -> None:
    """Executor initializer: on Linux a thread's nice value is its own (PRIO_PROCESS with its tid)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LARGE_TEXT_NICE)
    except (AttributeError, OSError):  # not Linux, or refused: the lane still works, at normal priority
        pass


class TextTokenizer(Protocol):
    """What the front end needs from `engine.tokenizer.Tokenizer`."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str: ...


class AsyncTokenizer:
    """`tokenize` / `detokenize` / `apply_chat_template` as coroutines run on worker threads."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer
        self._small = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize-small")
        self._large = ThreadPoolExecutor(max_workers=NUM_LARGE_TEXT_THREADS, thread_name_prefix="tokenize-large",
                                         initializer=lower_this_threads_priority)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        encode = functools.partial(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)
        return await self._run(len(text), encode)

    async def detokenize(self, token_ids: list[int]) -> str:
        decode = functools.partial(self.tokenizer.decode, token_ids, skip_special_tokens=True)
        return await self._run(len(token_ids) * 4, decode)

    async def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        size = sum(len(m.get("content", "")) for m in messages)
        render = functools.partial(self.tokenizer.apply_chat_template, messages,
                                   add_generation_prompt=add_generation_prompt)
        return await self._run(size, render)

    async def _run(self, size: int, work: Callable[[], T]) -> T:
        executor = self._small if size <= SMALL_TEXT_CHARS else self._large
        return await asyncio.get_running_loop().run_in_executor(executor, work)

    def shutdown(self) -> None:
        self._small.shutdown(wait=False, cancel_futures=True)
        self._large.shutdown(wait=False, cancel_futures=True)
