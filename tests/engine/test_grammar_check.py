"""Grammars are checked off the event loop (issue 34): size limits refuse at once, a compile runs in the
checker's worker processes under a timeout, and the client sends a constrained request to the core only once its
grammar compiled -- a failure ends the stream with the rejection, a client that leaves meanwhile leaves
nothing behind."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from engine_fakes import FakeRunner, FakeScheduler, make_fake_core
from hypothesis import given
from hypothesis import strategies as st
from proc_harness import serving

from conveyor.engine import grammar_check
from conveyor.engine.grammar_check import GrammarChecker, GrammarLimits
from conveyor.engine.types import GenerateRequest, RequestRejectedError
from conveyor.request import FinishReason
from conveyor.sampling_params import GrammarKind, SamplingParams, StructuredOutput

SRC = pathlib.Path(__file__).resolve().parents[2] / "src"


def choice(*options: str, field: str = "guided_choice") -> StructuredOutput:
    return StructuredOutput(GrammarKind.CHOICE, json.dumps(list(options)), field)


def req(request_id: str, constraint: StructuredOutput) -> GenerateRequest:
    return GenerateRequest(request_id, [105, 106], SamplingParams(max_tokens=3, structured_output=constraint))


def slow_compile(monkeypatch: pytest.MonkeyPatch, seconds: float) -> threading.Event:
    """Replace the compile by a sleep, on threads (a worker process would not see the fake); the event
    says it began."""
    began = threading.Event()

    def compile_grammar(constraint: StructuredOutput) -> str:
        began.set()
        time.sleep(seconds)
        return constraint.spec

    monkeypatch.setattr(grammar_check, "compile_grammar", compile_grammar)
    monkeypatch.setattr(grammar_check, "compile_processes", lambda n: ThreadPoolExecutor(n))
    return began


def test_size_limits_refuse_naming_the_field() -> None:
    limits = GrammarLimits(max_bytes=40, max_choices=3)
    with pytest.raises(RequestRejectedError, match=r"guided_choice: 4 choices, over .* limit of 3") as many:
        grammar_check.check_size(choice("a", "b", "c", "d"), limits)
    assert many.value.field == "guided_choice"
    regex = StructuredOutput(GrammarKind.REGEX, "x" * 41, "structured_outputs.regex")
    with pytest.raises(RequestRejectedError, match=r"41 bytes, over .* 40 \(--max-grammar-bytes\)") as big:
        grammar_check.check_size(regex, limits)
    assert big.value.field == "structured_outputs.regex"


@given(st.lists(st.text()), st.booleans())
def test_the_choice_count_is_exact_without_a_parse(choices: list[str], ascii_only: bool) -> None:
    """Quotes, backslashes, an escaped backslash before a closing quote, control and non-ASCII characters:
    the count of a choice list's JSON (as `json.dumps` writes it, either way) is its length."""
    assert grammar_check.num_strings(json.dumps(choices, ensure_ascii=ascii_only)) == len(choices)


def test_a_bad_grammar_is_refused_naming_the_field() -> None:
    async def main() -> None:
        checker = GrammarChecker()
        bad = StructuredOutput(GrammarKind.GRAMMAR, "root ::= (", "guided_grammar")
        with pytest.raises(RequestRejectedError, match="guided_grammar: the grammar does not compile") as error:
            await checker.check(bad)
        assert error.value.field == "guided_grammar"
        await checker.check(choice("yes", "no"))
        checker.shutdown()
    asyncio.run(main())


def test_a_compile_over_its_timeout_is_refused_and_never_oversubscribes(monkeypatch: pytest.MonkeyPatch) -> None:
    slow_compile(monkeypatch, 1.0)

    async def main() -> None:
        checker = GrammarChecker(GrammarLimits(compile_timeout_s=0.1, num_workers=1))
        start = time.monotonic()
        with pytest.raises(RequestRejectedError, match=r"did not compile within 0.1 s \(--grammar-compile-timeout\)"):
            await checker.check(choice("a"))
        assert time.monotonic() - start < 0.9  # answered before the compile ended
        # The timed-out compile still holds the one thread: the next waits for it rather than start its
        # own clock behind it, so it is refused for its own compile's length, not the wait.
        with pytest.raises(RequestRejectedError, match="did not compile"):
            await checker.check(choice("b"))
        assert time.monotonic() - start >= 0.9
        checker.shutdown()
    asyncio.run(main())


def test_the_event_loop_stays_free_while_a_huge_choice_compiles() -> None:
    """100,000 choices compile (for real) on a checker thread while the loop keeps ticking."""
    huge = choice(*(f"option-{i}" for i in range(100_000)))

    async def main() -> None:
        checker = GrammarChecker()
        gaps: list[float] = []
        done = asyncio.Event()

        async def tick() -> None:
            last = time.monotonic()
            while not done.is_set():
                await asyncio.sleep(0.01)
                gaps.append(time.monotonic() - last)
                last = time.monotonic()

        ticker = asyncio.ensure_future(tick())
        await asyncio.gather(*(checker.check(huge) for _ in range(3)))
        done.set()
        await ticker
        checker.shutdown()
        assert len(gaps) > 10 and max(gaps) < 1.0  # generous: a loaded 2-core machine
    asyncio.run(main())


def test_the_client_sends_a_constrained_request_once_its_grammar_compiled() -> None:
    async def main() -> None:
        async with serving(make_fake_core(runner=FakeRunner(delay_s=0.001))) as served:
            outputs = [o async for o in served.client.generate(req("ok", choice("yes", "no")))]
            assert outputs[-1].finish_reason is FinishReason.LENGTH
            stream = served.client.generate(req("bad", StructuredOutput(GrammarKind.REGEX, "a)", "guided_regex")))
            with pytest.raises(RequestRejectedError, match="guided_regex: the grammar does not compile") as error:
                await stream.__anext__()
            assert error.value.field == "guided_regex"
            assert served.client.num_unfinished_requests() == 0
    asyncio.run(main())


def test_a_client_that_leaves_during_the_compile_leaves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    began = slow_compile(monkeypatch, 0.5)

    async def main() -> None:
        scheduler = FakeScheduler()
        async with serving(make_fake_core(scheduler=scheduler, runner=FakeRunner(delay_s=0.001))) as served:
            stream = served.client.generate(req("gone", choice("a")))
            reading = asyncio.ensure_future(stream.__anext__())
            while not began.is_set():
                await asyncio.sleep(0.01)
            reading.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reading
            await stream.aclose()
            assert served.client.num_unfinished_requests() == 0
            await asyncio.sleep(0.7)  # the compile ends: the request must not reach the core now
            assert not scheduler.has_unfinished_requests()
    asyncio.run(main())


WORKERS_THEN_SIGKILL = """
import asyncio, json, multiprocessing, os, signal
from conveyor.engine.grammar_check import GrammarChecker
from conveyor.sampling_params import GrammarKind, StructuredOutput

asyncio.run(GrammarChecker().check(StructuredOutput(GrammarKind.CHOICE, '["a", "b"]', "guided_choice")))
print(json.dumps([p.pid for p in multiprocessing.active_children()]), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_compile_workers_exit_with_a_killed_server() -> None:
    """A pool worker holds both ends of its task queue and never sees EOF: before it watched its parent,
    every SIGKILLed server (each e2e test's end) left its compile workers running."""
    server = subprocess.Popen([sys.executable, "-c", WORKERS_THEN_SIGKILL], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(SRC)})
    assert server.stdout is not None
    workers = json.loads(server.stdout.readline())  # a line, not EOF: a leaked worker would hold the pipe open
    assert server.wait(timeout=60) == -signal.SIGKILL and workers
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid in workers if _alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)  # not to leave them to the rest of the run
    assert not left, f"compile workers outlived their server: {left}"


def _alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie nobody reaped yet."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _die(constraint: StructuredOutput) -> str:
    """A compile that crashes its worker (as native code may), for the test below; runs in a worker."""
    os._exit(3)


def test_a_compile_that_kills_its_worker_is_a_400_and_the_next_compiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool cannot run another compile once a worker died: the request is refused naming its field,
    and the next check starts new workers."""
    async def main() -> None:
        checker = GrammarChecker()
        with monkeypatch.context() as patched:
            patched.setattr(grammar_check, "compile_grammar", _die)
            with pytest.raises(RequestRejectedError, match="the grammar compiler's process ended") as error:
                await checker.check(choice("a"))
        assert error.value.field == "guided_choice"
        compiled = await checker.check(choice("yes", "no"))
        assert compiled.kind is GrammarKind.LLGUIDANCE
        checker.shutdown()
    asyncio.run(main())
