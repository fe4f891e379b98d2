"""Structured outputs in the worker: one llguidance matcher per constrained request, its next-token
bitmask filled on the host each step, applied to the logits by the sampler (worker/sampler.py).

Building a matcher (the grammar against the whole vocabulary) may take a second or more, so it never
runs in the step: `prepare` starts it on a compile thread when the
request arrives, and the engine core hands the request to the scheduler only once `is_ready` (vLLM's
WAITING_FOR_FSM); meanwhile every other request steps on. Only a preempted request, whose matcher is
dropped with its state, builds its new one in the step.

Model: a matcher's state is a function of the request's output tokens alone. Before each mask the
matcher is brought level with the request's known output (`RequestState.token_ids` past the prompt):
it consumes the tokens it has not seen. So nothing else has to tell it what was accepted: a decode
step's sampled token, a verified draft (speculative decoding is refused with structured outputs at
admission, but the rule would hold), or a preempted request that comes back with its earlier outputs
(its matcher was dropped with its state, and the new one consumes them all) all land the same way.
Under async scheduling the runner collects the step in flight first, so no placeholder is consumed; but
the EOS a request's last step drew reaches its matcher in the next step's mask, built before the engine
ended the request on it. llguidance stops a matcher at the end of its grammar and refuses every token
after, so a stopped matcher takes its end tokens here (`_consume`). vLLM's guidance backend lets a stopped
matcher take any token; here any other is still a failure (a token forced past the end of the grammar).

A matcher that falls into an error (a token it refuses; a mask it cannot compute, e.g. a JSON schema
whose `$ref` loops), or that cannot be built for this request, allows only EOS from then on, so the
request never runs on unconstrained. That EOS would read as a normal "stop" with text that does not
follow the grammar, so the failure is also reported: `take_failures` hands the step's new failures to
the runner's output, and the engine ends those requests with an error instead. Nothing here may raise
into the step: one request's grammar must never stop the engine for every other request.
Whose fault: a grammar that cannot be built, has no next token, or errors on a token (a limit of its
own, e.g. `a{1000000}`) is the request's (a 400 naming its field). A sampled token the grammar refuses is one its mask forbade: no bias or penalty lifts a -inf,
so only `min_tokens` can force one (it forbids EOS where the grammar allows nothing else), which is the
request's doing; past min_tokens it is the engine's fault (a 500: the request asked for nothing wrong).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from llguidance import LLMatcher, LLTokenizer

from conveyor.sampling_params import StructuredOutput
from conveyor.worker.grammar import grammar_of, one_line
from conveyor.worker.request_state import RequestState
from conveyor.worker.sampling_metadata import GrammarMask, host_to_device

logger = logging.getLogger(__name__)

COMPILE_NICE = 10
"""How much lower the compile thread's CPU priority is: it must not take a core from the step loop."""


@dataclass(frozen=True)
class GrammarVocab:
    """What the matchers need to know about the vocabulary."""

    tokenizer_json: Callable[[], str]
    """The tokenizer as tokenizer.json text (read once: indexing it takes ~0.4 s; `load_tokenizer`)."""
    vocab_size: int
    """Columns of the logits (may exceed the tokenizer's own vocabulary)."""
    eos_token_ids: tuple[int, ...]
    """Allowed once the grammar is complete: the EOS ids the engine stops on that the tokenizer knows (so
    a completed grammar always ends its request; engine/model_setup.py picks them)."""


@dataclass
class _Matcher:
    matcher: LLMatcher | None
    """None only when it could not be built (then `failed`)."""
    num_consumed: int = 0
    """Output tokens this matcher has consumed."""
    failed: bool = False
    error: str = ""
    """Why it could not be built (one line), when `matcher` is None."""


def make_tokenizer(vocab: GrammarVocab) -> LLTokenizer:
    """llguidance's view of the tokenizer over the logits' columns; `vocab.eos_token_ids` end a grammar.
    Should llguidance still refuse them, the tokenizer's own EOS ends it instead (logged): the engine
    stops on that one whenever the tokenizer names it (it is the primary EOS)."""
    text = vocab.tokenizer_json()
    try:
        return _with_eos(text, vocab)
    except ValueError as error:
        logger.warning("structured outputs: %s; grammars end on the tokenizer's own EOS", error)
        return LLTokenizer(text, n_vocab=vocab.vocab_size)


def _with_eos(text: str, vocab: GrammarVocab) -> LLTokenizer:
    """llguidance >= 1.7 takes a list of EOS ids; earlier releases (pyproject allows >= 1.0, and the GPU
    machine's image had 1.6.1) take one id and raise TypeError on a list: they get the first id."""
    ids = list(vocab.eos_token_ids)
    if not ids:
        return LLTokenizer(text, n_vocab=vocab.vocab_size)
    try:
        return LLTokenizer(text, n_vocab=vocab.vocab_size, eos_token=ids)
    except TypeError:
        return LLTokenizer(text, n_vocab=vocab.vocab_size, eos_token=ids[0])


class StructuredOutputs:
    """Per-request matchers and the step's bitmask for the rows that have a grammar."""

    def __init__(self, vocab: GrammarVocab) -> None:
        self._vocab = vocab
        self._tokenizer: LLTokenizer | None = None
        self._matchers: dict[str, _Matcher] = {}
        self._failures: dict[str, str | None] = {}
        """Requests whose grammar failed since the last `take_failures`, with the message for the client
        (None: the engine's fault, not the request's)."""
        self._building: dict[str, Future[_Matcher]] = {}
        """Matchers being built on the compile thread, by request id."""
        self._compiler: ThreadPoolExecutor | None = None
        self._num_words = (vocab.vocab_size + 31) // 32

    @property
    def tokenizer(self) -> LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = make_tokenizer(self._vocab)
        return self._tokenizer

    def load_tokenizer(self) -> None:
        """Index the vocabulary now, before the engine serves: llguidance's LLTokenizer holds the GIL for
        its whole ~0.4 s build, so built for the first constrained request it stalled every running stream
        by that much (measured 0.35 s). A failure is logged; each constrained request then fails alone."""
        if self._tokenizer is not None:
            return
        try:
            self._tokenizer = make_tokenizer(self._vocab)
        except Exception:  # the engine must start; `_build` then reports the failure per request
            logger.exception("structured outputs: the tokenizer could not be indexed")

    def prepare(self, request_id: str, constraint: StructuredOutput) -> None:
        """Start building the request's matcher on the compile thread; the step never waits for it."""
        if self._compiler is None:
            self._compiler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-build",
                                                initializer=_lower_this_threads_priority)
        self._building[request_id] = self._compiler.submit(self._build, request_id, constraint)

    def is_ready(self, request_id: str) -> bool:
        """Whether the request may be scheduled: its matcher is built (or was never prepared)."""
        building = self._building.get(request_id)
        return building is None or building.done()

    def wait(self, request_id: str, timeout_s: float) -> None:
        """Block until the request's matcher is built or `timeout_s` passed (an engine with nothing else
        to do waits here rather than spin through empty steps)."""
        building = self._building.get(request_id)
        if building is not None:
            concurrent.futures.wait([building], timeout=timeout_s)

    def shutdown(self) -> None:
        if self._compiler is not None:
            self._compiler.shutdown(wait=False, cancel_futures=True)

    def take_failures(self) -> dict[str, str | None]:
        """The grammar failures found since the last call (request id -> message naming the field, or
        None where the engine is at fault)."""
        failures, self._failures = self._failures, {}
        return failures

    def drop(self, request_ids: Iterable[str]) -> None:
        """Forget finished and preempted requests (a preempted one is rebuilt from its outputs)."""
        for request_id in request_ids:
            self._matchers.pop(request_id, None)
            building = self._building.pop(request_id, None)
            if building is not None:
                building.cancel()

    def mask(self, rows: Sequence[RequestState], device: torch.device) -> GrammarMask | None:
        """The bitmask for the sampling rows with a grammar (None when there are none)."""
        constrained = [(row, state) for row, state in enumerate(rows)
                       if state.sampling_params.structured_output is not None]
        if not constrained:
            return None
        bitmask = np.zeros((len(constrained), self._num_words), dtype=np.int32)  # [G, W]
        for index, (_, state) in enumerate(constrained):
            self._fill(state, bitmask, index)
        row_ids = host_to_device([row for row, _ in constrained], torch.int64, device)
        return GrammarMask(rows=row_ids, bitmask=torch.from_numpy(bitmask).to(device))

    def _fill(self, state: RequestState, bitmask: np.ndarray, index: int) -> None:
        entry = self._level(state)
        if not entry.failed:
            assert entry.matcher is not None  # only a failed entry has none
            row = bitmask[index]
            entry.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            if not entry.matcher.is_error():
                return
            self._fail(state, entry, f"no next token is possible ({one_line(entry.matcher.get_error())})")
        bitmask[index] = 0
        words = bitmask.view(np.uint32)
        for eos in self._vocab.eos_token_ids:
            words[index, eos // 32] |= np.uint32(1 << (eos % 32))

    def _fail(self, state: RequestState, entry: _Matcher, reason: str, engine_fault: bool = False) -> None:
        """From now on EOS only, and the failure is reported once: naming the request's field, or where
        the engine is at fault as an engine error (logged as one, with the reason)."""
        entry.failed = True
        constraint = state.sampling_params.structured_output
        field = constraint.field if constraint is not None else "structured_outputs"
        message = f"{field}: the output can no longer follow the grammar: {reason}"
        self._failures[state.request_id] = None if engine_fault else message
        if engine_fault:
            logger.error("request %s: %s, although the mask forbade it: ended as an engine error",
                         state.request_id, message)
        else:
            logger.warning("request %s: %s; only EOS is allowed now", state.request_id, message)

    def _level(self, state: RequestState) -> _Matcher:
        """The request's matcher, having consumed every known output token."""
        entry = self._matchers.get(state.request_id)
        if entry is None:
            constraint = state.sampling_params.structured_output
            assert constraint is not None
            building = self._building.pop(state.request_id, None)
            entry = building.result() if building is not None else self._build(state.request_id, constraint)
            self._matchers[state.request_id] = entry
            if entry.failed:
                self._fail(state, entry, f"it could not be built for this model's vocabulary ({entry.error})")
        outputs = state.token_ids[state.num_prompt_tokens:]
        if entry.failed or entry.num_consumed == len(outputs):
            return entry
        assert entry.matcher is not None
        new = list(outputs[entry.num_consumed:])
        accepted = self._consume(entry.matcher, new)
        entry.num_consumed = len(outputs)
        if accepted < len(new) or entry.matcher.is_error():
            refused = f"token {new[accepted]} refused" if accepted < len(new) else "matcher error"
            reason = one_line(entry.matcher.get_error()) or refused
            index = entry.num_consumed - len(new) + accepted
            # A plain refusal (no matcher error) is a token that got past the mask: only min_tokens can
            # force one (the module docstring). A matcher in error hit its grammar's own limit: a 400.
            engine_fault = (accepted < len(new) and not entry.matcher.is_error()
                            and index >= state.sampling_params.min_tokens)
            self._fail(state, entry, f"output token {index}: {reason}", engine_fault)
        return entry

    def _consume(self, matcher: LLMatcher, tokens: list[int]) -> int:
        """How many of `tokens` the matcher takes. llguidance stops a matcher as soon as its grammar is
        complete and only an end token may follow, and once stopped `try_consume_tokens` refuses every
        token, that end token too. Yet the end token does come: under async scheduling the next step's mask
        is built before the engine has ended the request on it, and with ignore_eos the request goes on
        drawing it. So a stopped matcher takes the end tokens (its mask stays "end only") and nothing else."""
        accepted = 0 if matcher.is_stopped() else matcher.try_consume_tokens(tokens)
        if accepted == len(tokens) or not matcher.is_stopped() or matcher.is_error():
            return accepted
        ends = _end_tokens(self.tokenizer)
        while accepted < len(tokens) and tokens[accepted] in ends:
            accepted += 1
        return accepted

    def _build(self, request_id: str, constraint: StructuredOutput) -> _Matcher:
        """A new matcher, or a failed entry (EOS only) if this grammar or tokenizer cannot make one."""
        try:
            return _Matcher(LLMatcher(self.tokenizer, grammar_of(constraint), log_level=0))
        except Exception as error:  # noqa: BLE001 - whatever llguidance raises, the step must go on
            logger.exception("request %s: its %s constraint could not be built; only EOS is allowed",
                             request_id, constraint.field)
            return _Matcher(None, failed=True, error=one_line(str(error)) or type(error).__name__)


def _end_tokens(tokenizer: LLTokenizer) -> frozenset[int]:
    """The tokens llguidance ends a grammar on (`make_tokenizer` may have fallen back to the tokenizer's
    own EOS); releases before 1.7 name one, `eos_token`."""
    return frozenset(getattr(tokenizer, "eos_tokens", None) or [tokenizer.eos_token])


def _lower_this_threads_priority() -> None:
    """Executor initializer: on Linux a thread's nice value is its own (PRIO_PROCESS with its tid)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICE)
    except (AttributeError, OSError):  # not Linux, or refused: the thread still works, at normal priority
        pass
