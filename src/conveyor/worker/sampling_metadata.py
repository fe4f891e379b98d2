"""Per-step sampler inputs, built from the requests that sample this step (one tensor per field).

Each field is `None` when no row of the batch needs that feature, so the sampler's common cases
(all greedy, no penalties, no logprobs) do no work for features nobody asked for.

Seeds: a seeded request's draw for output position `n` comes from a generator seeded with
`mix(seed, n)`. The stream is therefore a function of (seed, position) only: independent of which
other requests share the batch, and unchanged when a preempted request is recomputed and resumes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from conveyor.sampling_params import SamplingParams

_MASK_63 = (1 << 63) - 1
MIN_TEMPERATURE = 0.01
"""A random row's temperature is at least this (vLLM's rule): below it, logits / temperature overflow float32."""
MIN_REPETITION_PENALTY = 1e-30
"""Repetition penalties are at least this in float32 (1e-300 would round to 0, and logits / 0 is inf);
logits stay finite: |logit| / 1e-30 / MIN_TEMPERATURE < 3.4e38 for any |logit| < 3e6."""
_GOLDEN_64 = 0x9E3779B97F4A7C15


def seed_for_position(seed: int, num_output_tokens: int) -> int:
    """A well-mixed 63-bit seed for one (request seed, output position) pair (splitmix64 finaliser)."""
    z = (seed * _GOLDEN_64 + (num_output_tokens + 1) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & _MASK_63


@dataclass(frozen=True)
class SamplingRequest:
    """What the sampler needs from one request that samples this step."""

    params: SamplingParams
    token_ids: Sequence[int]
    """Prompt + output tokens known before this step's sample."""
    num_prompt_tokens: int
    """How many of token_ids are prompt."""
    generator: torch.Generator | None = None
    """The request's own generator (seeded requests only); re-seeded here for its next position."""

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass(frozen=True)
class PenaltyInputs:
    """Rows with repetition/frequency/presence penalties and their token histories (padded with V)."""

    rows: torch.Tensor
    """[M] int64: which rows of the logits these are."""
    prompt_token_ids: torch.Tensor
    """[M, P] int64, padded with vocab_size."""
    output_token_ids: torch.Tensor
    """[M, O] int64, padded with vocab_size."""
    repetition: torch.Tensor
    """[M] float32."""
    frequency: torch.Tensor
    """[M] float32."""
    presence: torch.Tensor
    """[M] float32."""


@dataclass(frozen=True)
class RandomSampling:
    """The rows that draw at random (temperature > 0) and their parameters, indexed 0..R-1."""

    rows: torch.Tensor | None
    """[R] int64 rows of the logits (None when every row draws at random: no gather needed)."""
    temperature: torch.Tensor
    """[R] float32, all > 0."""
    top_k: torch.Tensor | None
    """[R] int64, vocab_size where unset (None when no row sets top_k)."""
    top_p: torch.Tensor | None
    """[R] float32, 1.0 where unset (None when no row sets top_p < 1)."""
    min_p: torch.Tensor | None
    """[R] float32 (None when no row sets min_p)."""
    max_top_k: int
    """Largest k over the rows (vocab_size when some row sets none): the candidates kept per row."""
    generators: dict[int, torch.Generator]
    """index in 0..R-1 -> the seeded request's generator, positioned for this step."""


@dataclass(frozen=True)
class LogitBias:
    """(row, token, bias) triples added to the logits (OpenAI's logit_bias)."""

    rows: torch.Tensor
    """[K] int64."""
    token_ids: torch.Tensor
    """[K] int64."""
    values: torch.Tensor
    """[K] float32, in [-100, 100]."""


@dataclass(frozen=True)
class GrammarMask:
    """The tokens a structured-output grammar allows next, for the rows that have one."""

    rows: torch.Tensor
    """[G] int64 rows of the logits."""
    bitmask: torch.Tensor
    """[G, ceil(V / 32)] int32: bit j of word w allows token 32 w + j (llguidance's layout)."""


@dataclass(frozen=True)
class SamplingBatch:
    """Sampler inputs for N rows of logits."""

    num_rows: int
    random: RandomSampling | None
    """None when every row is greedy: the sample is one argmax."""
    penalties: PenaltyInputs | None
    masked_rows: torch.Tensor | None
    """[K] int64 row of each (row, token) pair that min_tokens forbids this step."""
    masked_token_ids: torch.Tensor | None
    """[K] int64 token of each pair."""
    num_logprobs: list[int | None]
    """Per row: top alternatives requested (None: no logprobs)."""
    logit_bias: LogitBias | None = None
    """None when no row sets logit_bias."""
    grammar: GrammarMask | None = None
    """None when no row has a structured-output grammar (the runner fills it in)."""

    @property
    def all_greedy(self) -> bool:
        return self.random is None

    @property
    def max_num_logprobs(self) -> int | None:
        requested = [n for n in self.num_logprobs if n is not None]
        return max(requested) if requested else None


@dataclass(frozen=True)
class VocabInfo:
    """Vocabulary facts the builder needs."""

    vocab_size: int
    """Columns of the logits."""
    eos_token_ids: frozenset[int]
    """Masked while min_tokens is not reached, with or without ignore_eos (as vLLM 0.24 masks them)."""


def build_sampling_batch(
    requests: Sequence[SamplingRequest], vocab: VocabInfo, device: torch.device
) -> SamplingBatch:
    masked_rows, masked_tokens = _min_tokens_pairs(requests, vocab, device)
    return SamplingBatch(
        num_rows=len(requests),
        random=_random_sampling(requests, vocab.vocab_size, device),
        penalties=_penalty_inputs(requests, vocab.vocab_size, device),
        masked_rows=masked_rows,
        masked_token_ids=masked_tokens,
        num_logprobs=[r.params.logprobs for r in requests],
        logit_bias=_logit_bias(requests, device),
    )


def _logit_bias(requests: Sequence[SamplingRequest], device: torch.device) -> LogitBias | None:
    triples = [(row, token_id, bias) for row, request in enumerate(requests)
               for token_id, bias in request.params.logit_bias]
    if not triples:
        return None
    rows, token_ids, values = zip(*triples)
    return LogitBias(host_to_device(list(rows), torch.int64, device), host_to_device(list(token_ids), torch.int64, device),
                     _floats(list(values), device))


def _random_sampling(
    requests: Sequence[SamplingRequest], vocab_size: int, device: torch.device
) -> RandomSampling | None:
    rows = [i for i, r in enumerate(requests) if r.params.temperature > 0.0]
    if not rows:
        return None
    chosen = [requests[i] for i in rows]
    params = [r.params for r in chosen]
    top_ks = [p.top_k if p.top_k is not None and p.top_k < vocab_size else vocab_size for p in params]
    return RandomSampling(
        rows=None if len(rows) == len(requests) else host_to_device(rows, torch.int64, device),
        temperature=_floats([max(p.temperature, MIN_TEMPERATURE) for p in params], device),
        top_k=host_to_device(top_ks, torch.int64, device) if min(top_ks) < vocab_size else None,
        top_p=_floats([p.top_p for p in params], device) if any(p.top_p < 1.0 for p in params) else None,
        min_p=_floats([p.min_p for p in params], device) if any(p.min_p > 0.0 for p in params) else None,
        max_top_k=max(top_ks),
        generators=_position_generators(chosen),
    )


def _floats(values: list[float], device: torch.device) -> torch.Tensor:
    return host_to_device(values, torch.float32, device)


def host_to_device(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor without a blocking copy: a pageable copy would wait for the work
    already queued on the stream (the previous step, under async scheduling); pinned memory does not."""
    tensor = torch.tensor(data, dtype=dtype)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def _position_generators(requests: Sequence[SamplingRequest]) -> dict[int, torch.Generator]:
    generators: dict[int, torch.Generator] = {}
    for index, request in enumerate(requests):
        seed = request.params.seed
        if request.generator is None or seed is None:
            continue
        request.generator.manual_seed(seed_for_position(seed, request.num_output_tokens))
        generators[index] = request.generator
    return generators


def _min_tokens_pairs(
    requests: Sequence[SamplingRequest], vocab: VocabInfo, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    rows: list[int] = []
    tokens: list[int] = []
    for row, request in enumerate(requests):
        params = request.params
        if request.num_output_tokens >= params.min_tokens:
            continue
        # every EOS id, ignore_eos or not: vLLM's min_tokens masks `_all_stop_token_ids`, which holds them all
        stop_ids = {t for t in set(params.stop_token_ids) | vocab.eos_token_ids if t < vocab.vocab_size}
        rows.extend([row] * len(stop_ids))
        tokens.extend(sorted(stop_ids))
    if not rows:
        return None, None
    return host_to_device(rows, torch.int64, device), host_to_device(tokens, torch.int64, device)


def has_penalty(params: SamplingParams) -> bool:
    """Repetition, frequency or presence penalty: the row reads the request's whole token history."""
    return (params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0
            or params.presence_penalty != 0.0)


def _padded(rows: list[Sequence[int]], pad_id: int, device: torch.device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    data = [list(r) + [pad_id] * (width - len(r)) for r in rows]
    return host_to_device(data, torch.int64, device)


def _penalty_inputs(
    requests: Sequence[SamplingRequest], vocab_size: int, device: torch.device
) -> PenaltyInputs | None:
    rows = [i for i, r in enumerate(requests) if has_penalty(r.params)]
    if not rows:
        return None
    chosen = [requests[i] for i in rows]
    return PenaltyInputs(
        rows=host_to_device(rows, torch.int64, device),
        prompt_token_ids=_padded([r.token_ids[: r.num_prompt_tokens] for r in chosen], vocab_size, device),
        output_token_ids=_padded([r.token_ids[r.num_prompt_tokens:] for r in chosen], vocab_size, device),
        repetition=_floats([max(r.params.repetition_penalty, MIN_REPETITION_PENALTY) for r in chosen], device),
        frequency=_floats([r.params.frequency_penalty for r in chosen], device),
        presence=_floats([r.params.presence_penalty for r in chosen], device),
    )
