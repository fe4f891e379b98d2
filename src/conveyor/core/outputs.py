"""The contract between the scheduler (ints) and the worker (tensors): the only types that cross.

The worker keeps a persistent per-request state (token ids, block table, sampler state) and the
scheduler sends only what changed, as vLLM V1 does:

- `NewRequestData`: a request the worker has not seen, or one resumed after preemption (the worker
  dropped it then). It carries every known token (prompt + output so far) and the full block table.
- `CachedRequestData`: the requests the worker already holds, as one struct of parallel lists (index
  i of each list is one request, vLLM V1's layout): the blocks each appended this step and its computed
  count. Tokens sampled by the worker are appended by the worker itself, so none travel back. One
  object per step rather than one per request: with hundreds of decodes this keeps the per-request cost
  of a step to a few list appends.

For every scheduled request the worker computes `num_scheduled_tokens[req_id]` tokens starting at
position `num_computed_tokens`, writes their KV into the slots of the block table, and samples one
token if that range reaches the end of the request's known tokens (a partial prefill chunk samples
nothing). `finished_req_ids` and `preempted_req_ids` tell it which states to drop.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import KW_ONLY, dataclass, field

from conveyor.request import FinishReason, RequestTimings
from conveyor.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    """A request (re)entering the worker."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    """Tokens generated before a preemption (empty for a fresh request); they are recomputed."""
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    """Tokens whose KV is already in the listed blocks (prefix-cache hit), before this step."""


PLACEHOLDER_TOKEN_ID = -1
"""Async scheduling: an input token sampled by a step whose result is not back yet (never a real id).
The worker appends it to its token ids and fills it from the pending step's sampled tensor; the
scheduler holds no placeholder tokens, it counts them (`Request.num_output_placeholders`)."""

NO_NEW_BLOCKS: tuple[int, ...] = ()
"""`CachedRequestData.new_block_ids` entry of a request that got no block this step (shared, immutable)."""


@dataclass(frozen=True)
class CachedRequestData:
    """The requests the worker already holds, scheduled again: parallel lists, one index per request."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[Sequence[int]] = field(default_factory=list)
    """Blocks appended to each request's table this step (mostly `NO_NEW_BLOCKS`: read, never mutate)."""
    num_computed_tokens: list[int] = field(default_factory=list)
    """Tokens of each request with KV in the cache before this step."""

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def append(self, request_id: str, new_block_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Add one request (while the step is built; the lists stay parallel)."""
        self.req_ids.append(request_id)
        self.new_block_ids.append(new_block_ids)
        self.num_computed_tokens.append(num_computed_tokens)

    def remove(self, request_id: str) -> None:
        """Withdraw one request (a preemption victim scheduled earlier in the step); absent is a no-op."""
        if request_id in self.req_ids:
            index = self.req_ids.index(request_id)
            del self.req_ids[index], self.new_block_ids[index], self.num_computed_tokens[index]


@dataclass(frozen=True)
class SchedulerOutput:
    """What one step computes. Requests appear in batch order: cached (running) first, then new."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)
    """Requests that ended since the last step: the worker drops their state."""
    preempted_req_ids: set[str] = field(default_factory=set)
    """Requests preempted this step: the worker drops their state; they return as new later."""
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    """Speculative decoding: the draft tokens each request verifies this step. They are the last
    `len(drafts)` of its `num_scheduled_tokens` (which is 1 + len(drafts) for a decode), so its range
    must reach them: num_computed_tokens + num_scheduled_tokens = its token count + len(drafts). The
    worker feeds them as inputs, samples at every one of those positions and keeps the accepted
    prefix. Rollback is the scheduler's: after the step it sets num_computed_tokens = before +
    num_scheduled_tokens - (len(drafts) - num_accepted), num_accepted = len(sampled_token_ids) - 1,
    which is the request's token count after the step minus one (the token just sampled has no KV
    yet); the KV slots of rejected drafts hold stale values the next step overwrites, and the worker
    keeps no drafts (its token ids are prompt + kept outputs)."""

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probability of one sampled token and the top alternatives at that position."""

    token_id: int
    logprob: float
    rank: int
    """1-based rank of the sampled token among all tokens."""
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(frozen=True)
class ModelRunnerOutput:
    """What the worker returns for one `SchedulerOutput`.

    `sampled_token_ids[req_id]` is empty for a request whose step was a partial prefill chunk; else
    it holds the accepted draft tokens (speculative decoding) followed by one token sampled by the
    target model, so 1 to 1 + len(drafts) tokens.
    """

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """Speculative decoding: draft tokens proposed for each request's next step (absent: none), at
    most num_speculative_tokens and never at or past max_model_len. The scheduler stores them on the
    request and schedules them with its next decode (it may trim them, e.g. to the budget or to
    max_tokens). With a draft model it must also reserve `SpeculativeConfig.num_lookahead_tokens`
    KV slots past the scheduled tokens (the draft writes its proposals' KV there); a request with
    fewer slots gets fewer drafts."""
    grammar_errors: dict[str, str | None] = field(default_factory=dict)
    """Requests whose output can no longer follow their structured-outputs grammar (request id -> a
    message naming the request field, or None where the engine is at fault, e.g. it sampled a token the
    mask forbade): the engine ends them as errors, not as a stop on the EOS that the worker's mask forced
    this step."""


@dataclass(frozen=True)
class EngineCoreOutput:
    """One request's news: a finish (stop, length, abort, queue timeout) with its whole record, or, when
    `EngineCoreOutputs` is iterated, one request's tokens from a step."""

    request_id: str
    new_token_ids: list[int]
    _: KW_ONLY  # the rest by keyword: three ints in a row would swap silently
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    """The stop token id that matched (stop strings are matched later, by the detokenizer)."""
    timings: RequestTimings | None = None
    """Set on the finishing output only: the request's full timestamps, for latency metrics."""
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (set on the finishing output)."""
    num_preemptions: int = 0
    """Times this request was preempted (set on the finishing output)."""
    error_message: str | None = None
    """Why a request finished with ERROR when its own input caused it (its grammar could not be followed),
    for the client; None with ERROR: an engine fault."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class EngineCoreOutputs:
    """Everything one `Scheduler.update_from_output` reports, batched per step (as vLLM V1 does).

    The common case, a request that got tokens and goes on, is one index of the parallel lists
    (`req_ids[i]` kept `new_token_ids[i]`): two list appends per request and step, no object. Requests
    that finished come whole, as `EngineCoreOutput`s in `finished_outputs`. A request appears at most
    once. Iterating yields one `EngineCoreOutput` per request (built on demand) for consumers that want
    them one by one.
    """

    req_ids: list[str] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)
    """Tokens each going-on request kept this step (may be the runner's own lists: read, never mutate)."""
    new_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    """Logprobs of those tokens, only for the going-on requests that asked for them."""
    finished_outputs: list[EngineCoreOutput] = field(default_factory=list)
    """Requests that finished since the last update (their new tokens included)."""

    def __len__(self) -> int:
        return len(self.req_ids) + len(self.finished_outputs)

    def __iter__(self) -> Iterator[EngineCoreOutput]:
        """The going-on requests (in batch order), then the finished ones."""
        new_logprobs = self.new_logprobs
        for request_id, token_ids in zip(self.req_ids, self.new_token_ids):
            yield EngineCoreOutput(request_id, token_ids, new_logprobs=new_logprobs.get(request_id, []))
        yield from self.finished_outputs
