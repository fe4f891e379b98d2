"""Test doubles for the engine: a byte-level tokenizer (each token is raw bytes, like byte-level BPE)."""

from __future__ import annotations

SPECIAL_EOS = 0


class ByteTokenizer:
    """Token id = byte value + 1 for single bytes; extra multi-byte tokens from `merges`; 0 is EOS."""

    def __init__(self, merges: list[bytes] | None = None) -> None:
        self.pieces: list[bytes] = [b"<eos>"] + [bytes([b]) for b in range(256)] + list(merges or [])
        self.eos_token_id = SPECIAL_EOS

    def token_id(self, piece: bytes) -> int:
        return self.pieces.index(piece)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b + 1 for b in text.encode("utf-8")]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        parts = [self.pieces[t] for t in token_ids if not (skip_special_tokens and t == SPECIAL_EOS)]
        return b"".join(parts).decode("utf-8", errors="replace")

    def ids_for(self, chunks: list[bytes]) -> list[int]:
        """Token ids for explicit byte chunks (each chunk must be a single byte or a merge)."""
        return [self.token_id(c) for c in chunks]


# --- a scheduler and runner with the core/worker contracts, for engine tests without a model ---

from conveyor.config import EngineConfig  # noqa: E402
from conveyor.core.errors import QueueFullError  # noqa: E402
from conveyor.core.outputs import (  # noqa: E402
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreOutputs,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from conveyor.core.stats import SchedulerStats  # noqa: E402
from conveyor.engine.engine_core import EngineCore, ModelLimits  # noqa: E402
from conveyor.request import FinishReason, Request, RequestStatus  # noqa: E402


class FakeScheduler:
    """Whole-prompt prefill, one token per step, FCFS, `max_running` at once; usage = running share."""

    def __init__(self, max_running: int = 4, max_queued: int | None = None,
                 queue_timeout_s: float | None = None, clock=None) -> None:
        import time
        self.clock = clock or time.monotonic
        self.max_running, self.max_queued, self.queue_timeout_s = max_running, max_queued, queue_timeout_s
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.finished_ids: set[str] = set()
        self.num_schedules = 0
        self.resets: list[bool] = []  # reset_prefix_cache calls, by their reset_running_requests

    def add_request(self, request: Request) -> None:
        if self.max_queued is not None and len(self.waiting) >= self.max_queued:
            raise QueueFullError("queue full")
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        self.num_schedules += 1
        new = []
        while self.waiting and len(self.running) < self.max_running:
            request = self.waiting.pop(0)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            new.append(request)
        counts = {r.request_id: r.num_tokens - r.num_computed_tokens for r in self.running}
        new_data = [NewRequestData(r.request_id, r.prompt_token_ids, [], r.sampling_params, [0], 0) for r in new]
        held = [r for r in self.running if r not in new]
        cached = CachedRequestData([r.request_id for r in held], [[] for _ in held],
                                   [r.num_computed_tokens for r in held])
        finished, self.finished_ids = self.finished_ids, set()
        return SchedulerOutput(new_data, cached, counts, sum(counts.values()), finished)

    def update_from_output(self, sched: SchedulerOutput, runner_out: ModelRunnerOutput):
        outputs = EngineCoreOutputs(finished_outputs=self._timeouts())
        for request in list(self.running):
            if request.request_id not in sched.num_scheduled_tokens:
                continue
            request.num_computed_tokens += sched.num_scheduled_tokens[request.request_id]
            new_ids = runner_out.sampled_token_ids.get(request.request_id, [])
            request.output_token_ids.extend(new_ids)
            reason = self._finish_reason(request)
            if reason is not None:
                outputs.finished_outputs.append(self._finish(request, reason, new_ids))
            else:
                outputs.req_ids.append(request.request_id)
                outputs.new_token_ids.append(list(new_ids))
        stats = SchedulerStats(num_running_reqs=len(self.running), num_waiting_reqs=len(self.waiting),
                               kv_cache_usage=self.kv_usage, num_scheduled_tokens=sched.total_num_scheduled_tokens)
        return outputs, stats

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Refused while requests run (they would hold KV blocks) unless forced; calls recorded."""
        self.resets.append(reset_running_requests)
        return reset_running_requests or not self.running

    @property
    def kv_usage(self) -> float:
        return len(self.running) / self.max_running

    def _timeouts(self) -> list[EngineCoreOutput]:
        if self.queue_timeout_s is None:
            return []
        late = [r for r in self.waiting if self.clock() - r.arrival_s > self.queue_timeout_s]
        return [self._finish(r, FinishReason.QUEUE_TIMEOUT, []) for r in late]

    def _finish_reason(self, request: Request) -> FinishReason | None:
        if request.output_token_ids and request.output_token_ids[-1] == request.eos_token_id \
                and not request.sampling_params.ignore_eos:
            return FinishReason.STOP
        if request.max_tokens is not None and request.num_output_tokens >= request.max_tokens:
            return FinishReason.LENGTH
        return None

    def _finish(self, request: Request, reason: FinishReason, new_ids: list[int]) -> EngineCoreOutput:
        for queue in (self.waiting, self.running):
            if request in queue:
                queue.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.timings.finished_s = self.clock()
        self.finished_ids.add(request.request_id)
        return EngineCoreOutput(request.request_id, list(new_ids), finish_reason=reason, timings=request.timings,
                                num_prompt_tokens=request.num_prompt_tokens)

    def finish_requests(self, request_ids, reason: FinishReason) -> list[EngineCoreOutput]:
        live = {r.request_id: r for r in self.waiting + self.running}
        return [self._finish(live[i], reason, []) for i in request_ids if i in live]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def check_invariants(self) -> None:
        assert not set(map(id, self.waiting)) & set(map(id, self.running))


class FakeRunner:
    """Samples the byte of the next letter of `text` cycling (as ByteTokenizer ids), per request."""

    def __init__(self, text: bytes = b"abcdefghij", fail_after: int | None = None, delay_s: float = 0.0) -> None:
        self.text, self.fail_after, self.delay_s = text, fail_after, delay_s
        self.position: dict[str, int] = {}
        self.num_executes = 0

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.num_executes += 1
        if self.delay_s:
            import time
            time.sleep(self.delay_s)
        if self.fail_after is not None and self.num_executes > self.fail_after:
            raise RuntimeError("injected runner failure")
        for new in sched.scheduled_new_reqs:
            self.position[new.request_id] = 0
        sampled = {}
        for request_id in sched.num_scheduled_tokens:
            position = self.position[request_id]
            sampled[request_id] = [self.text[position % len(self.text)] + 1]
            self.position[request_id] = position + 1
        return ModelRunnerOutput(sampled)


def make_fake_core(config: EngineConfig | None = None, scheduler: FakeScheduler | None = None,
                   runner: FakeRunner | None = None) -> EngineCore:
    config = config or EngineConfig(check_invariants=True)
    limits = ModelLimits(num_kv_blocks=64, max_model_len=config.scheduler.max_model_len,
                         eos_token_ids=(SPECIAL_EOS,), vocab_size=257)
    return EngineCore(config, runner or FakeRunner(), scheduler or FakeScheduler(), limits)
