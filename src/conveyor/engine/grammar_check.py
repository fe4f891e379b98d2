"""Structured-output grammars checked off the event loop: size limits first (cheap, on the request), then
a compile in a small pool of worker processes under a timeout. What does not pass is a
RequestRejectedError naming the field (a 400), so the engine core only ever sees grammars that
compiled, and it sees them compiled: the request goes on with llguidance's serialized grammar
(GrammarKind.LLGUIDANCE) in place of its constraint, because building that is Python work (for
100,000 choices, a JSON parse and an escape per choice: ~90 ms) that in the engine process shared the
GIL with the step loop and stretched a step of every running stream by as much (measured: a 99 ms gap).

Why processes and not threads: llguidance's compiler itself releases the GIL, but what comes before it
does not (for 100,000 choices ~130 ms of JSON parsing, escaping and regex building); on a compile
thread that took the GIL from the event loop in turns and every stream's next chunk waited (measured:
loop pauses of 45-105 ms on 2 cores). A worker process shares no GIL, and a compile that crashes
(llguidance is native code) ends that worker, not the API server. The workers are spawned on the first
constrained request, run at a lower CPU priority (on few cores a compile must not take one from the
engine's step loop) and stay for the next; what crosses is the constraint and the grammar text (a
pickle of a few MB, in the pool's own threads).

A compile cannot be interrupted. One that overruns its timeout is answered at once and finishes in the
background, still holding its worker; a slot is freed only when the worker is, so at most
`num_workers` compiles ever run. A request waiting for a free worker has not started its timeout: the
timeout bounds the compile, and the admission caps (--max-num-queued-reqs) bound how many requests may
wait.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

from conveyor.engine.async_tokenizer import lower_this_threads_priority
from conveyor.engine.types import GenerateRequest, RequestRejectedError
from conveyor.sampling_params import GrammarKind, StructuredOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GrammarLimits:
    """What one request's structured-outputs constraint may cost the front end."""

    max_bytes: int = 2 * 1024 * 1024
    """Largest constraint text in UTF-8 bytes (a choice list counts as its JSON; --max-grammar-bytes)."""
    max_choices: int = 100_000
    """Most strings a choice constraint may list (--max-grammar-choices)."""
    compile_timeout_s: float = 30.0
    """A grammar that takes longer to compile is a 400 (--grammar-compile-timeout)."""
    num_workers: int = 2
    """Compiles that may run at once (worker processes); more wait for a free worker."""

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_choices", "num_workers"):
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
        count = num_strings(constraint.spec)
        if count > limits.max_choices:
            raise RequestRejectedError(constraint.field, f"{constraint.field}: {count} choices, over the server's "
                                                         f"limit of {limits.max_choices} (--max-grammar-choices)")


def num_strings(json_list: str) -> int:
    """How many strings a JSON list of strings holds, without building them (parsing 100,000 took 5-15 ms
    of the event loop, on top of the body's own parse): with the escaped backslashes taken out, then the
    escaped quotes (left to right, as JSON reads them), each string is exactly two quotes."""
    return json_list.replace("\\\\", "").replace('\\"', "").count('"') // 2


def compile_grammar(constraint: StructuredOutput) -> str:
    """The constraint's llguidance grammar (what a compile worker runs); GrammarError, a ValueError that
    pickles, if it does not compile."""
    from conveyor.worker.grammar import check_grammar  # llguidance, no torch

    return check_grammar(constraint)


def compile_check(constraint: StructuredOutput) -> StructuredOutput:
    """Compile the constraint here and now (blocking: the offline LLM): the compiled constraint, or
    RequestRejectedError naming the field if it does not compile."""
    try:
        return compiled(constraint, compile_grammar(constraint))
    except ValueError as error:
        raise not_compiled(constraint, error) from None


def compiled(constraint: StructuredOutput, grammar: str) -> StructuredOutput:
    return StructuredOutput(GrammarKind.LLGUIDANCE, grammar, constraint.field)


def not_compiled(constraint: StructuredOutput, error: ValueError) -> RequestRejectedError:
    return RequestRejectedError(constraint.field, f"{constraint.field}: the grammar does not compile: {error}")


def with_constraint(request: GenerateRequest, constraint: StructuredOutput) -> GenerateRequest:
    """The request with `constraint` (its compiled form) in place of the one it came with."""
    params = dataclasses.replace(request.sampling_params, structured_output=constraint)
    return dataclasses.replace(request, sampling_params=params)


def compile_processes(num_workers: int) -> Executor:
    """The compile workers: spawned (a fork of a threaded server could inherit a held lock)."""
    return ProcessPoolExecutor(num_workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=start_compile_worker)


def start_compile_worker() -> None:
    """Pool initializer, in each worker: a lower CPU priority (set on the main thread, it is the whole
    worker's), and an exit with the API server however it ends: a pool worker holds both ends of its
    task queue, so it never sees EOF there (SIGKILLed servers left their workers behind)."""
    lower_this_threads_priority()
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=_exit_with, args=(parent.sentinel,), name="exit-with-server", daemon=True).start()


def _exit_with(sentinel: int) -> None:
    multiprocessing.connection.wait([sentinel])
    os._exit(0)


class GrammarChecker:
    """`check` a constraint without blocking the event loop: at most `num_workers` compiles at once.
    `make_pool` makes the executor the compiles run on (None: `compile_processes`; tests give threads)."""

    def __init__(self, limits: GrammarLimits = GrammarLimits(),
                 make_pool: Callable[[int], Executor] | None = None) -> None:
        self.limits = limits
        self._make_pool = make_pool or compile_processes
        self._pool: Executor | None = None  # started by the first check: most servers never see a grammar
        self._slots: asyncio.Semaphore | None = None  # made on the serving loop, at the first check

    async def check(self, constraint: StructuredOutput) -> StructuredOutput:
        """The compile in a worker (the caller checked the size limits at admission, `check_size`): the
        compiled constraint, or RequestRejectedError naming the field."""
        loop = asyncio.get_running_loop()
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.limits.num_workers)
        slots = self._slots
        await slots.acquire()
        if self._pool is None:
            self._pool = self._make_pool(self.limits.num_workers)
        pool = self._pool
        try:
            future = pool.submit(compile_grammar, constraint)
        except BrokenProcessPool:  # broken by another request's compile, not replaced yet
            slots.release()
            raise self._replace_broken(pool, constraint) from None
        future.add_done_callback(lambda _: _call_soon(loop, slots.release))
        try:
            return compiled(constraint, await asyncio.wait_for(asyncio.wrap_future(future),
                                                               self.limits.compile_timeout_s))
        except ValueError as error:
            raise not_compiled(constraint, error) from None
        except asyncio.TimeoutError:
            timeout = self.limits.compile_timeout_s
            raise RequestRejectedError(constraint.field, f"{constraint.field}: the grammar did not compile within "
                                                         f"{timeout:g} s (--grammar-compile-timeout)") from None
        except BrokenProcessPool:
            raise self._replace_broken(pool, constraint) from None

    def _replace_broken(self, pool: Executor, constraint: StructuredOutput) -> RequestRejectedError:
        """A worker died (llguidance crashed, or it was killed): the pool cannot run another compile, so
        the next check starts a new one; the compiles that were in it are refused."""
        if self._pool is pool:
            logger.error("a grammar compile worker died while compiling %s; starting new workers", constraint.field)
            pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        return RequestRejectedError(constraint.field, f"{constraint.field}: the grammar compiler's process ended "
                                                      "while compiling it")

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _call_soon(loop: asyncio.AbstractEventLoop, callback: object) -> None:
    """Run `callback` on `loop` from a pool thread; after shutdown the loop is gone and nothing waits."""
    try:
        loop.call_soon_threadsafe(callback)  # type: ignore[arg-type]
    except RuntimeError:
        pass

