"""A deterministic stand-in for `AsyncEngineClient`, implementing `EngineClient` on the event loop.

Tokenizer: one token per character (`ord`), plus BOS = 1 with special tokens. Output token i is id
`1000 + i` with text `" w{i}"`. `max_num_seqs` requests run at once, the rest wait (timing out after
`queue_timeout_s`). Admission is the real one (`engine.admission`: lengths, in-flight and prefill-token
caps), raised from `generate` as the real client does, and so is the grammar check (`engine.grammar_check`:
size limits at once, the compile on its threads, a failure raised from the stream); `abort` ends a stream with a final ABORT
output; stats listeners are called after every token and at every finish; `die()` plays the engine
core's death.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from conveyor.config import SchedulerConfig
from conveyor.core.lifecycle import KVPoolSize
from conveyor.engine.admission import AdmissionControl, QueueLimits, RequestLimits, check_request
from conveyor.engine.grammar_check import GrammarChecker, GrammarLimits, check_size
from conveyor.engine.types import (
    EngineDeadError,
    EngineInfo,
    FinishedRequestStats,
    GenerateRequest,
    IterationStats,
    LogprobEntry,
    RequestOutput,
    SchedulerStats,
    StatsListener,
)
from conveyor.request import FinishReason, RequestTimings

BOS_ID = 1
FIRST_OUTPUT_ID = 1000


def output_text(num_tokens: int) -> str:
    return "".join(f" w{i}" for i in range(num_tokens))


@dataclass(frozen=True)
class FakeEngineConfig:
    """Knobs of the fake engine."""

    model_name: str = "fake-model"
    max_model_len: int = 128
    max_num_seqs: int = 4
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    queue_timeout_s: float | None = None
    token_delay_s: float = 0.0
    held_back_tokens: frozenset[int] = frozenset()
    """Output indexes whose text the "detokenizer" holds back: they arrive with empty text, and their text
    comes with the next token (as half a UTF-8 character does)."""
    num_kv_blocks: int = 64
    block_size: int = 16
    vocab_size: int = 2_000_000
    grammar: GrammarLimits = GrammarLimits()


@dataclass
class _State:
    """What the tests inspect afterwards."""

    running: set[str] = field(default_factory=set)
    num_waiting: int = 0
    aborted: list[str] = field(default_factory=list)
    finished: dict[str, FinishReason] = field(default_factory=dict)
    abort_requested: set[str] = field(default_factory=set)
    requests: list[GenerateRequest] = field(default_factory=list)
    num_prefix_cache_resets: int = 0
    frozen: bool = False
    """Stands for a stopped engine core: check_health waits out its timeout."""


class FakeEngine:
    def __init__(self, config: FakeEngineConfig = FakeEngineConfig()) -> None:
        self.config = config
        self.state = _State()
        self.dead = False
        self.shut_down = False
        self._listeners: list[StatsListener] = []
        self._dead_listeners: list = []
        self._slots = asyncio.Semaphore(config.max_num_seqs)
        self._limits = RequestLimits(SchedulerConfig(max_model_len=config.max_model_len),
                                     KVPoolSize(config.num_kv_blocks, config.block_size), config.vocab_size)
        self.admission = AdmissionControl(QueueLimits(config.max_num_queued_reqs, config.max_num_queued_tokens))
        self.grammars = GrammarChecker(config.grammar)
        self.step_log: list | None = None
        """The engine's step records (None: --step-log-size 0); a test fills it, GET /step_log drains it."""

    @property
    def info(self) -> EngineInfo:
        c = self.config
        return EngineInfo(model_name=c.model_name, max_model_len=c.max_model_len, block_size=c.block_size,
                          num_kv_blocks=c.num_kv_blocks, vocab_size=c.vocab_size,
                          config={"max-num-seqs": str(c.max_num_seqs), "block-size": str(c.block_size)})

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([BOS_ID] if add_special_tokens else []) + [ord(ch) for ch in text]

    async def detokenize(self, token_ids: list[int]) -> str:
        return "".join(chr(t) for t in token_ids if t != BOS_ID)

    async def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def add_stats_listener(self, listener: StatsListener) -> None:
        self._listeners.append(listener)

    def add_dead_listener(self, listener) -> None:  # noqa: ANN001
        self._dead_listeners.append(listener)

    def num_unfinished_requests(self) -> int:
        if self.dead:
            raise EngineDeadError("fake engine is dead")
        return len(self.state.running) + self.state.num_waiting

    @property
    def is_running(self) -> bool:
        return not (self.dead or self.shut_down)

    async def abort(self, request_id: str) -> None:
        self.state.abort_requested.add(request_id)

    async def check_health(self, timeout_s: float) -> bool:
        if self.state.frozen:
            await asyncio.sleep(timeout_s)
        return self.is_running and not self.state.frozen

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """As the engine core: refused while requests run (they hold KV blocks), unless forced."""
        if self.state.running and not reset_running_requests:
            return False
        self.state.num_prefix_cache_resets += 1
        return True

    async def drain_step_log(self) -> list | None:
        if self.step_log is None:
            return None
        records, self.step_log = self.step_log, []
        return records

    async def shutdown(self) -> None:
        self.shut_down = True
        self.grammars.shutdown()

    def die(self) -> None:
        """The engine core died: live streams fail at their next token, the dead listeners run."""
        self.dead = True
        for listener in self._dead_listeners:
            listener()

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        if self.dead:
            raise EngineDeadError("fake engine is dead")
        check_request(request.prompt_token_ids, request.sampling_params, self._limits)
        if request.sampling_params.structured_output is not None:
            check_size(request.sampling_params.structured_output, self.config.grammar)
        self.admission.admit(request.request_id, len(request.prompt_token_ids))
        return self._admitted(request)

    async def _admitted(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        outputs = self._run(request)
        try:
            if request.sampling_params.structured_output is not None:
                await self.grammars.check(request.sampling_params.structured_output)
            async for output in outputs:
                if self.dead:
                    raise EngineDeadError("fake engine died")
                if output.num_output_tokens:
                    self.admission.prefill_done(request.request_id)
                yield output
        finally:
            await outputs.aclose()  # (not running: we are suspended at our own yield or done)
            self.admission.release(request.request_id)

    def _emit(self, finished: list[FinishedRequestStats], **counts: int) -> None:
        usage = len(self.state.running) / self.config.max_num_seqs / 2
        stats = SchedulerStats(num_running_reqs=len(self.state.running), num_waiting_reqs=self.state.num_waiting,
                               kv_cache_usage=usage, step_time_s=time.monotonic(), **counts)
        for listener in self._listeners:
            listener(IterationStats(stats, finished))

    async def _run(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        prompt = request.prompt_token_ids
        max_tokens = request.sampling_params.max_tokens or self.config.max_model_len - len(prompt)
        self.state.requests.append(request)
        rid = request.request_id
        timings = RequestTimings(arrival_s=time.monotonic())
        num_output = 0
        reason: FinishReason | None = None
        self.state.num_waiting += 1
        try:
            try:
                await asyncio.wait_for(self._slots.acquire(), self.config.queue_timeout_s)
            except asyncio.TimeoutError:
                reason = FinishReason.QUEUE_TIMEOUT
            finally:
                self.state.num_waiting -= 1
            if reason is FinishReason.QUEUE_TIMEOUT:
                self._finish(rid, reason, timings, prompt, 0, num_queue_timeouts=1)
                yield RequestOutput(rid, "", [], len(prompt), 0, reason, error_message="queue timeout after "
                                    f"{self.config.queue_timeout_s} s", prompt_token_ids=prompt)
                return
            self.state.running.add(rid)
            timings.first_scheduled_s = time.monotonic()
            try:
                async for output in self._decode(request, prompt, max_tokens, timings):
                    num_output = output.num_output_tokens
                    reason = output.finish_reason
                    yield output
            finally:
                self.state.running.discard(rid)
                self._slots.release()
            if reason is None and rid in self.state.abort_requested:  # abort(): a final ABORT output
                reason = FinishReason.ABORT
                self.state.aborted.append(rid)
                self._finish(rid, reason, timings, prompt, num_output)
                yield RequestOutput(rid, "", [], len(prompt), num_output, reason)
        finally:
            if reason is None:  # the consumer left
                self.state.aborted.append(rid)
                self._finish(rid, FinishReason.ABORT, timings, prompt, num_output)

    async def _decode(self, request: GenerateRequest, prompt: list[int], max_tokens: int,
                      timings: RequestTimings) -> AsyncIterator[RequestOutput]:
        params = request.sampling_params
        held = ""
        for i in range(max_tokens):
            await asyncio.sleep(self.config.token_delay_s)
            if request.request_id in self.state.abort_requested:
                return
            now = time.monotonic()
            timings.first_token_s = timings.first_token_s or now
            timings.last_token_s = now
            timings.token_times_s.append(now)
            token_id = FIRST_OUTPUT_ID + i
            reason = None
            if token_id in params.stop_token_ids:
                reason = FinishReason.STOP
            elif i == max_tokens - 1:
                reason = FinishReason.LENGTH
            text = f" w{i}"
            logprobs = [] if params.logprobs is None else [LogprobEntry(
                text, token_id, -0.5, [(text, -0.5)] + [(f" alt{k}", -1.0 - k) for k in range(params.logprobs)])]
            if reason is None:
                self._emit([], num_generation_tokens=1, num_scheduled_tokens=len(prompt) if i == 0 else 1)
            else:
                self._finish(request.request_id, reason, timings, prompt, i + 1, num_generation_tokens=1)
            held, new_text = (held + text, "") if i in self.config.held_back_tokens and reason is None else ("", held + text)
            yield RequestOutput(request.request_id, new_text, [token_id], len(prompt), i + 1, reason,
                                stop_reason=token_id if reason is FinishReason.STOP else None,
                                new_logprobs=logprobs, prompt_token_ids=prompt if i == 0 else [])
            if reason is not None:
                return

    def _finish(self, rid: str, reason: FinishReason, timings: RequestTimings, prompt: list[int],
                num_output: int, **counts: int) -> None:
        timings.finished_s = time.monotonic()
        self.state.running.discard(rid)  # gauges are the state after the step
        self.state.finished[rid] = reason
        stats = FinishedRequestStats(finish_reason=reason, timings=timings, num_prompt_tokens=len(prompt),
                                     num_generation_tokens=num_output, num_cached_tokens=0, num_preemptions=0,
                                     request_id=rid)
        self._emit([stats], **counts)
