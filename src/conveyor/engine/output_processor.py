"""Turns the core's per-step `EngineCoreOutput`s into the caller-facing `RequestOutput`s.

Runs beside the caller, never in the engine core: on the API process's event loop when serving
(`core_client`), in the `LLM`'s own thread offline. One `_RequestState` per live request holds its
incremental detokenizer and counters. A stop string is only visible here (the core sees token ids),
so on a match the final `RequestOutput` is emitted at once and the request id is returned in
`stop_string_request_ids`; the caller must then finish it in the core (`FinishReason.STOP`). The
core's finishing output for it comes back through `process` later and yields only its
`FinishedRequestStats` (timings), never a second final output; tokens the core produced in between
are dropped.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from conveyor.core.outputs import EngineCoreOutput, TokenLogprobs
from conveyor.engine.detokenizer import Decoder, DetokenizerUpdate, IncrementalDetokenizer
from conveyor.engine.types import FinishedRequestStats, LogprobEntry, RequestOutput
from conveyor.request import FinishReason, RequestTimings
from conveyor.sampling_params import SamplingParams

ENGINE_ERROR_MESSAGE = "the engine failed while running this request"


@dataclass
class _RequestState:
    """What the processor remembers about one live request."""

    request_id: str
    prompt_token_ids: list[int]
    detokenizer: IncrementalDetokenizer
    arrival_s: float
    num_output_tokens: int = 0
    sent_first: bool = False
    final_sent: bool = False
    """A stop string already produced the final output; only the scheduler's finish is pending."""
    stop_reason: int | str | None = None
    grammar_field: str | None = None
    """The request field of its structured-outputs constraint: what a grammar failure is reported under."""


@dataclass
class ProcessedOutputs:
    """The caller-facing result of one batch of core outputs."""

    request_outputs: list[RequestOutput] = field(default_factory=list)
    finished_stats: list[FinishedRequestStats] = field(default_factory=list)
    stop_string_request_ids: list[str] = field(default_factory=list)
    """Requests a stop string ended: finish them in the scheduler with FinishReason.STOP."""


class OutputProcessor:
    """Detokenizes, counts and finishes requests; one thread (or event loop) drives it."""

    def __init__(self, tokenizer: Decoder, queue_timeout_s: float | None) -> None:
        self._tokenizer = tokenizer
        self._queue_timeout_s = queue_timeout_s
        self._states: dict[str, _RequestState] = {}

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_s: float) -> None:
        detokenizer = IncrementalDetokenizer(self._tokenizer, prompt_token_ids, params)
        constraint = params.structured_output
        self._states[request_id] = _RequestState(request_id, prompt_token_ids, detokenizer, arrival_s,
                                                 grammar_field=constraint.field if constraint is not None else None)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._states

    def live_request_ids(self) -> list[str]:
        return [rid for rid, state in self._states.items() if not state.final_sent]

    @property
    def num_requests(self) -> int:
        return len(self._states)

    def process(self, core_outputs: Iterable[EngineCoreOutput]) -> ProcessedOutputs:
        """A step's `EngineCoreOutputs` (iterated one request at a time) or `finish_requests`' list."""
        result = ProcessedOutputs()
        for core_output in core_outputs:
            state = self._states.get(core_output.request_id)
            if state is None:
                continue  # already finished here (e.g. aborted twice)
            if state.final_sent:
                if core_output.finished:  # tokens the core made before our abort reached it are dropped
                    self._finish(state, core_output, result)
            else:
                self._process_one(state, core_output, result)
        return result

    def fail_all(self, message: str) -> list[RequestOutput]:
        """The engine died: a final ERROR output for every live request (states are dropped)."""
        outputs = [self._error_output(state, message) for state in self._states.values() if not state.final_sent]
        self._states.clear()
        return outputs

    def _process_one(self, state: _RequestState, core_output: EngineCoreOutput, result: ProcessedOutputs) -> None:
        update = state.detokenizer.update(core_output.new_token_ids, finished=core_output.finished)
        num_new = update.num_tokens_consumed
        finish_reason, stop_reason = core_output.finish_reason, core_output.stop_reason
        if update.stop_string is not None:
            finish_reason, stop_reason = FinishReason.STOP, update.stop_string
            state.stop_reason = stop_reason
            if not core_output.finished:
                result.stop_string_request_ids.append(state.request_id)
        state.num_output_tokens += num_new
        result.request_outputs.append(self._request_output(state, core_output, update, (finish_reason, stop_reason)))
        if finish_reason is None:
            return
        state.final_sent = True
        if core_output.finished:
            self._finish(state, core_output, result, finish_reason)

    def _request_output(self, state: _RequestState, core_output: EngineCoreOutput, update: DetokenizerUpdate,
                        reasons: tuple[FinishReason | None, int | str | None]) -> RequestOutput:
        num_new = update.num_tokens_consumed
        first = not state.sent_first
        state.sent_first = True
        return RequestOutput(
            request_id=state.request_id,
            new_text=update.new_text,
            new_token_ids=list(core_output.new_token_ids[:num_new]),
            num_prompt_tokens=len(state.prompt_token_ids),
            num_output_tokens=state.num_output_tokens,
            finish_reason=reasons[0],
            stop_reason=reasons[1],
            error_message=core_output.error_message or self._error_message(reasons[0]),
            error_param=state.grammar_field if core_output.error_message is not None else None,
            new_logprobs=[self._logprob_entry(lp) for lp in core_output.new_logprobs[:num_new]],
            prompt_token_ids=list(state.prompt_token_ids) if first else [],
            num_cached_tokens=core_output.num_cached_tokens,
        )

    def _finish(self, state: _RequestState, core_output: EngineCoreOutput, result: ProcessedOutputs,
                finish_reason: FinishReason | None = None) -> None:
        del self._states[state.request_id]
        reason = finish_reason or core_output.finish_reason or FinishReason.ABORT
        result.finished_stats.append(FinishedRequestStats(
            finish_reason=reason,
            timings=core_output.timings or RequestTimings(arrival_s=state.arrival_s),
            num_prompt_tokens=len(state.prompt_token_ids),
            num_generation_tokens=state.num_output_tokens,
            num_cached_tokens=core_output.num_cached_tokens,
            num_preemptions=core_output.num_preemptions,
            request_id=state.request_id,
        ))

    def _error_message(self, reason: FinishReason | None) -> str | None:
        if reason is FinishReason.QUEUE_TIMEOUT:
            return f"request waited longer than --queue-timeout={self._queue_timeout_s}s in the queue"
        if reason is FinishReason.ERROR:
            return ENGINE_ERROR_MESSAGE
        return None

    def _error_output(self, state: _RequestState, message: str) -> RequestOutput:
        return RequestOutput(
            request_id=state.request_id, new_text="", new_token_ids=[],
            num_prompt_tokens=len(state.prompt_token_ids), num_output_tokens=state.num_output_tokens,
            finish_reason=FinishReason.ERROR, error_message=message,
            prompt_token_ids=[] if state.sent_first else list(state.prompt_token_ids),
        )

    def _logprob_entry(self, logprobs: TokenLogprobs) -> LogprobEntry:
        top = [(self._token_text(t), lp) for t, lp in zip(logprobs.top_token_ids, logprobs.top_logprobs)]
        return LogprobEntry(self._token_text(logprobs.token_id), logprobs.token_id, logprobs.logprob, top)

    def _token_text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)
