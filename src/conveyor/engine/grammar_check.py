"""Structured-output grammars checked off the event loop: size limits first (O(1) on the request), then a
compile on a small thread pool under a timeout. What does not pass is a RequestRejectedError naming the
field (a 400), so the engine core only ever sees grammars that compiled, and it sees them compiled:
the request goes on with llguidance's serialized grammar (GrammarKind.LLGUIDANCE) in place of its
constraint, because building that is Python work (for 100,000 choices, a JSON parse and an escape per
choice: ~90 ms) that in the engine process shared the GIL with the step loop and stretched a step of
every running stream by as much (measured: a 99 ms gap).

Why threads and not processes: llguidance's compiler releases the GIL (measured: a 6 s compile of
100,000 alternatives on a thread left the event loop's longest pause at 34 ms), so a thread keeps
`/health` and every stream responsive without shipping a megabyte grammar to another process. The
threads run at a lower CPU priority: on a machine with few cores, a compile must not take a core from
the engine process's step loop.

A compile cannot be interrupted. One that overruns its timeout is answered at once and finishes in the
background, still holding its thread; a slot is freed only when the thread is, so at most `num_threads`
compiles ever run. A request waiting for a free thread has not started its timeout: the timeout bounds
the compile, and the admission caps (--max-num-queued-reqs) bound how many requests may wait.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from conveyor.engine.async_tokenizer import lower_this_threads_priority
from conveyor.engine.types import GenerateRequest, RequestRejectedError
from conveyor.sampling_params import GrammarKind, StructuredOutput


@dataclass(frozen=True)
class GrammarLimits:
    """What one request's structured-outputs constraint may cost the front end."""

    max_bytes: int = 2 * 1024 * 1024
    """Largest constraint text in UTF-8 bytes (a choice list counts as its JSON; --max-grammar-bytes)."""
    max_choices: int = 100_000
    """Most strings a choice constraint may list (--max-grammar-choices)."""
    compile_timeout_s: float = 30.0
    """A grammar that takes longer to compile is a 400 (--grammar-compile-timeout)."""
    num_threads: int = 2
    """Compiles that may run at once; more wait for a free thread."""

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_choices", "num_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if not self.compile_timeout_s > 0:
            raise ValueError(f"compile_timeout_s must be > 0 (got {self.compile_timeout_s})")


def check_size(constraint: StructuredOutput, limits: GrammarLimits) -> None:
    """Refuse a constraint over the size limits before any work is spent on it."""
    size = len(constraint.spec.encode("utf-8", "surrogatepass"))
    if size > limits.max_bytes:
        raise RequestRejectedError(constraint.field, f"{constraint.field}: the constraint is {size} bytes, over the "
                                                     f"server's limit of {limits.max_bytes} (--max-grammar-bytes)")
    if constraint.kind is GrammarKind.CHOICE:
        count = len(json.loads(constraint.spec))
        if count > limits.max_choices:
            raise RequestRejectedError(constraint.field, f"{constraint.field}: {count} choices, over the server's "
                                                         f"limit of {limits.max_choices} (--max-grammar-choices)")


def compile_check(constraint: StructuredOutput) -> StructuredOutput:
    """Compile the constraint now (blocking): the compiled constraint, or RequestRejectedError naming the
    field if it does not compile."""
    from conveyor.worker.grammar import GrammarError, check_grammar  # llguidance, no torch

    try:
        grammar = check_grammar(constraint)
    except GrammarError as error:
        raise RequestRejectedError(constraint.field, f"{constraint.field}: the grammar does not compile: "
                                                     f"{error}") from None
    return StructuredOutput(GrammarKind.LLGUIDANCE, grammar, constraint.field)


def with_constraint(request: GenerateRequest, constraint: StructuredOutput) -> GenerateRequest:
    """The request with `constraint` (its compiled form) in place of the one it came with."""
    params = dataclasses.replace(request.sampling_params, structured_output=constraint)
    return dataclasses.replace(request, sampling_params=params)


class GrammarChecker:
    """`check` a constraint without blocking the event loop: at most `num_threads` compiles at once."""

    def __init__(self, limits: GrammarLimits = GrammarLimits()) -> None:
        self.limits = limits
        self._pool = ThreadPoolExecutor(max_workers=limits.num_threads, thread_name_prefix="grammar-compile",
                                        initializer=lower_this_threads_priority)
        self._slots: asyncio.Semaphore | None = None  # made on the serving loop, at the first check

    async def check(self, constraint: StructuredOutput) -> StructuredOutput:
        """The compile on a pool thread (the caller checked the size limits at admission, `check_size`):
        the compiled constraint, or RequestRejectedError naming the field."""
        loop = asyncio.get_running_loop()
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.limits.num_threads)
        slots = self._slots
        await slots.acquire()
        future = self._pool.submit(compile_check, constraint)
        future.add_done_callback(lambda _: _call_soon(loop, slots.release))
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.limits.compile_timeout_s)
        except asyncio.TimeoutError:
            timeout = self.limits.compile_timeout_s
            raise RequestRejectedError(constraint.field, f"{constraint.field}: the grammar did not compile within "
                                                         f"{timeout:g} s (--grammar-compile-timeout)") from None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _call_soon(loop: asyncio.AbstractEventLoop, callback: object) -> None:
    """Run `callback` on `loop` from a pool thread; after shutdown the loop is gone and nothing waits."""
    try:
        loop.call_soon_threadsafe(callback)  # type: ignore[arg-type]
    except RuntimeError:
        pass

