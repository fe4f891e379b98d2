"""The two ends of a request's life in the scheduler: the admission checks and the stop checks.

Admission rejects what could never finish, so that nothing accepted is left waiting forever: a prompt
with no room for output under `max_model_len`, an explicit `max_tokens` past it, or a sequence the KV
pool cannot hold even when empty. Every accepted request gets a length limit, `max_num_tokens`
(prompt + output): the smallest of prompt + max_tokens, max_model_len and what the whole pool holds
(the last sampled token needs no slot, hence the +1). Stops are checked after each appended token, in
order: EOS (unless ignore_eos) and stop token ids, both ignored until `min_tokens` outputs exist; then
the length limit (max_tokens and max_model_len both end as LENGTH). The conditions are folded into a
`StopSpec` at admission, so that the scheduler's update loop pays one set lookup and one comparison
per token in the common case (no stop) and calls `check_stop` only for a candidate.

EOS follows vLLM: a model may end a turn on several ids (Llama-3.1-Instruct: config eos [128001, 128008,
128009], turns end on 128009). `EosTokenIds` names them: the primary (the tokenizer's EOS) stops with
no stop_reason; every other one is a stop token id reported as the stop_reason.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from conveyor.arith import cdiv
from conveyor.config import SchedulerConfig
from conveyor.core.errors import AdmissionError
from conveyor.request import FinishReason, Request
from conveyor.sampling_params import SamplingParams


@dataclass(frozen=True)
class EosTokenIds:
    """The end-of-sequence ids a model's requests stop on, resolved once at start-up."""

    primary: int | None
    """The tokenizer's EOS, else the model's first EOS id (vLLM's `eos_token_id`): no stop_reason."""
    model: tuple[int, ...] = ()
    """The model's EOS ids: generation_config.json's `eos_token_id`, else config.json's."""

    @classmethod
    def resolve(cls, tokenizer_eos: int | None, model_eos: tuple[int, ...]) -> EosTokenIds:
        return cls(tokenizer_eos if tokenizer_eos is not None else next(iter(model_eos), None), tuple(model_eos))

    @property
    def all(self) -> tuple[int, ...]:
        """Every id that ends a request without ignore_eos: the primary first, no repeats."""
        head = () if self.primary is None else (self.primary,)
        return tuple(dict.fromkeys(head + self.model))


def with_eos_stop_ids(params: SamplingParams, eos: EosTokenIds) -> SamplingParams:
    """The params a request runs with: unless ignore_eos, every EOS id joins its stop token ids (vLLM's
    `update_from_generation_config`). The primary joins too, so that the worker's min_tokens mask (built
    from the params on every tensor-parallel rank) suppresses all of them; `check_stop` still reports the
    primary as no stop_reason, as it is the request's eos_token_id."""
    if params.ignore_eos or not eos.all:
        return params
    return dataclasses.replace(params, stop_token_ids=tuple(dict.fromkeys(params.stop_token_ids + eos.all)))


@dataclass(frozen=True)
class KVPoolSize:
    """The size of the scheduler's KV block pool, as admission sees it (the worker's allocation is
    `worker.kv_cache.KVCapacity`)."""

    num_blocks: int
    """Blocks in the pool."""
    block_size: int
    """Tokens per block."""

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)


def check_admission(request: Request, config: SchedulerConfig, capacity: KVPoolSize) -> int:
    """Raise AdmissionError naming the field if the request can never finish; else its max_num_tokens."""
    num_prompt = len(request.prompt_token_ids)
    max_model_len = config.max_model_len
    max_tokens = request.sampling_params.max_tokens
    if num_prompt == 0:
        raise AdmissionError("prompt", "must contain at least one token")
    if num_prompt > max_model_len or (max_tokens is None and num_prompt >= max_model_len):
        raise AdmissionError("prompt", f"has {num_prompt} tokens, leaving no room for output under "
                             f"max_model_len ({max_model_len}); shorten the prompt")
    if max_tokens is not None and num_prompt + max_tokens > max_model_len:
        raise AdmissionError("max_tokens", f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) "
                             f"exceeds max_model_len ({max_model_len}); lower max_tokens to at most "
                             f"{max_model_len - num_prompt}")
    if capacity.blocks_for(num_prompt + 1) > capacity.num_blocks:
        raise AdmissionError("prompt", f"has {num_prompt} tokens but the KV cache holds only "
                             f"{capacity.num_blocks * capacity.block_size - 1} + 1 tokens; shorten it")
    if max_tokens is not None and capacity.blocks_for(num_prompt + max_tokens - 1) > capacity.num_blocks:
        raise AdmissionError("max_tokens", f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) "
                             f"cannot fit the KV cache ({capacity.num_blocks * capacity.block_size} "
                             "token slots); lower max_tokens")
    limit = min(max_model_len, capacity.num_blocks * capacity.block_size + 1)
    return limit if max_tokens is None else min(limit, num_prompt + max_tokens)


@dataclass(frozen=True)
class StopSpec:
    """A request's stop conditions, precomputed at admission so the per-token check is one lookup."""

    stop_token_ids: frozenset[int]
    """EOS (unless ignore_eos) and the stop token ids."""
    min_tokens: int
    """Stop tokens are ignored while fewer outputs exist."""
    max_num_output_tokens: int
    """The length limit, as output tokens (max_tokens, or what max_model_len / the pool leave)."""
    eos_token_id: int | None
    """EOS when it counts (None under ignore_eos): it stops with no stop_reason."""


def make_stop_spec(request: Request, max_num_tokens: int) -> StopSpec:
    params = request.sampling_params
    eos = None if params.ignore_eos else request.eos_token_id
    stop_ids = frozenset(params.stop_token_ids) | (frozenset() if eos is None else frozenset([eos]))
    return StopSpec(stop_token_ids=stop_ids, min_tokens=params.min_tokens,
                    max_num_output_tokens=max_num_tokens - len(request.prompt_token_ids), eos_token_id=eos)


def check_stop(request: Request, token_id: int, spec: StopSpec) -> FinishReason | None:
    """After `token_id` was appended to the request's outputs: why it stops, or None. A stop token id
    that matched is left in `request.stop_reason` (EOS is reported as no stop reason, as in vLLM)."""
    num_output_tokens = len(request.output_token_ids)
    if token_id in spec.stop_token_ids and num_output_tokens >= spec.min_tokens:
        request.stop_reason = None if token_id == spec.eos_token_id else token_id
        return FinishReason.STOP
    if num_output_tokens >= spec.max_num_output_tokens:
        return FinishReason.LENGTH
    return None
