"""The sampler: logits of the rows that sample this step → one token id each (+ logprobs on request).

The pipeline follows vLLM V1, in this order:
1. raw logprobs = log_softmax(model logits), kept only if some row asked for logprobs (vLLM's default
   `raw_logprobs` mode: the numbers describe the model, not the processed distribution);
2. min_tokens: EOS (unless ignore_eos) and stop token ids get -inf until min_tokens are generated;
3. penalties: repetition (HF/vLLM: over prompt + output tokens, positive logits divided, negative
   multiplied), then frequency and presence (OpenAI: over output tokens, subtracted);
4. greedy rows: argmax, exactly (an all-greedy batch without penalties does nothing but one argmax);
5. random rows: divide by temperature, min_p, then top_k / top_p over each row's best
   `max_top_k` candidates (a top-k of 50 instead of a sort of the vocabulary), then draw by the
   exponential race (argmax of p / q with q ~ Exp(1), equivalent to a categorical draw) so that each
   seeded row draws its noise from its own generator and unseeded rows share the runner's generator.

The fused path: on CUDA with Triton, a batch whose random rows all do plain temperature sampling (no
top-k, top-p, min-p) from the shared generator (no seed of their own) skips steps 4-5: the inverse-CDF
kernels (kernels/cdf_sample.py: per-tile softmax masses, then one uniform a row picks a tile and a column
in it) draw every row, greedy rows at temperature 0 (exact argmax), in one read of the logits and one
tile a row. Without edits (2, 3, logit_bias, grammar) it reads the LM head's logits as they come (bf16),
with no float32 copy; logprobs are taken in float32 either way. Everything else, and the CPU, takes
the staged path, unchanged (seeded rows reproduce exactly as before).

Memory: step 5 (worker/sampler_staged.py), the penalties and the grammar mask go through the rows in
chunks whose [rows, V] temporaries fit `SAMPLER_CHUNK_BYTES`, with the same tokens as one whole-batch
pass; what stays whole is the shared noise [R, K], the raw logprobs and, where edits need one, the float32
copy of the logits (without edits the staged path reads the LM head's bf16 logits chunk by chunk). The
runner hands the LM head's logits over in a `HandedLogits`, so that the float32 copy replaces them instead of
living beside them: at 1,024 rows x 128,256 tokens the bf16 logits (0.245 GiB) are freed before the noise
and the row chunks are allocated.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from conveyor.core.outputs import TokenLogprobs
from conveyor.kernels.cdf_sample import cdf_sample, cdf_sample_supported
from conveyor.worker.sampler_staged import (
    SAMPLER_CHUNK_BYTES,
    row_chunks,
    staged_sample,
)
from conveyor.worker.sampling_metadata import (
    PenaltyInputs,
    RandomSampling,
    SamplingBatch,
)

SEED_BOUND = 1 << 62
"""The fused kernel's per-step Philox seed is drawn from [0, SEED_BOUND) with the shared generator."""


class SamplingPath(enum.Enum):
    """How a batch is drawn (see the module docstring)."""

    GREEDY = "greedy"
    """Every row greedy: one argmax."""
    FUSED = "fused"
    """The inverse-CDF kernels for every row: plain temperature sampling, shared generator, CUDA + Triton."""
    STAGED = "staged"
    """Temperature, min-p, top-k / top-p, then the exponential race (per-row generators for seeded rows)."""


def sampling_path(batch: SamplingBatch, fused_available: bool) -> SamplingPath:
    """The path for `batch`; fused_available: whether the fused kernels run on the logits' device."""
    random = batch.random
    if random is None:
        return SamplingPath.GREEDY
    plain = random.top_k is None and random.top_p is None and random.min_p is None and not random.generators
    return SamplingPath.FUSED if plain and fused_available else SamplingPath.STAGED


def edits_logits(batch: SamplingBatch) -> bool:
    """Whether the logits change before the draw (grammar, logit_bias, min_tokens, penalties)."""
    return (batch.grammar is not None or batch.logit_bias is not None or batch.masked_rows is not None
            or batch.penalties is not None)


def reads_lm_head_logits(batch: SamplingBatch, fused_available: bool) -> bool:
    """Whether `Sampler.sample` reads the LM head's logits in their own dtype (bf16) instead of a float32
    copy: only where the fused kernel exists (the CPU converts as it always did) and only without edits
    (they write the logits, in float32). No path writes them otherwise: the fused kernel reads them as they
    are, and the staged path promotes one row chunk at a time to float32 as it scales it, so a batch of 1,024
    rows x 128,256 tokens never holds a 0.49 GiB float32 copy (the same tokens: the promotion is exact)."""
    return fused_available and not edits_logits(batch)


class HandedLogits:
    """The LM head's logits, handed to the sampler with their caller's only reference. `Sampler.sample` takes
    them out, so where it converts them to float32 the copy is the only tensor left alive: a caller holding
    the bf16 logits in a local would keep 2 B/logit alive through the noise and the row chunks (0.245 GiB at
    1,024 x 128,256), above what the start-up profile reserves for the edited path."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor: torch.Tensor | None = tensor

    def peek(self) -> torch.Tensor:
        """The logits, still held here (raw logprobs read them before the sampler takes them)."""
        assert self._tensor is not None, "the sampler has taken these logits already"
        return self._tensor

    def take(self) -> torch.Tensor:
        """The logits; this holder lets go of them (once only)."""
        tensor = self.peek()
        self._tensor = None
        return tensor


def _peek(logits: torch.Tensor | HandedLogits) -> torch.Tensor:
    return logits.peek() if isinstance(logits, HandedLogits) else logits


@dataclass(frozen=True)
class SamplerOutput:
    """One sampled token per row, and its logprobs where the row asked for them."""

    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    """Stateless apart from the shared generator used by rows without their own seed, and the byte budget
    of the row chunks the staged path and the edits go through (`worker/sampler_staged.py`; None: the
    whole batch at once, as before chunking -- the same tokens, more memory)."""

    def __init__(self, generator: torch.Generator, chunk_bytes: int | None = SAMPLER_CHUNK_BYTES) -> None:
        self.generator = generator
        self.chunk_bytes = chunk_bytes

    def __call__(self, logits: torch.Tensor | HandedLogits, batch: SamplingBatch) -> SamplerOutput:
        """logits: [N, V] float32 (modified in place) or the LM head's dtype (see `sample`)."""
        raw = raw_logprobs(_peek(logits), batch)
        sampled = self.sample(logits, batch)  # [N] int64
        token_ids = sampled.tolist()
        if raw is None:
            return SamplerOutput(token_ids, [None] * batch.num_rows)
        return SamplerOutput(token_ids, gather_logprobs(raw, sampled, batch.num_logprobs))

    def sample(self, logits: torch.Tensor | HandedLogits, batch: SamplingBatch) -> torch.Tensor:
        """[N] int64 token ids left on the device (no host sync). logits [N, V]: float32, modified in
        place, or the LM head's dtype, read as they are where `reads_lm_head_logits` says so and
        converted to float32 otherwise (handed over: the copy replaces them, see `HandedLogits`).
        Logprobs, if wanted, must be taken before (see `__call__`)."""
        if isinstance(logits, HandedLogits):
            logits = logits.take()  # this frame's name is now the only reference
        assert logits.dim() == 2 and logits.shape[0] == batch.num_rows, logits.shape
        fused_available = cdf_sample_supported(logits.device)
        if not reads_lm_head_logits(batch, fused_available):
            logits = logits.float()  # float32 logits: the same tensor, edited in place below
        if batch.grammar is not None:
            apply_token_bitmask(logits, batch.grammar.rows, batch.grammar.bitmask, self.chunk_bytes)
        if batch.logit_bias is not None:
            bias = batch.logit_bias
            logits.index_put_((bias.rows, bias.token_ids), bias.values, accumulate=True)
        if batch.masked_rows is not None:
            logits[batch.masked_rows, batch.masked_token_ids] = float("-inf")
        if batch.penalties is not None:
            apply_penalties(logits, batch.penalties, self.chunk_bytes)
        path = sampling_path(batch, fused_available)
        if path is SamplingPath.GREEDY:
            return logits.argmax(dim=-1)
        assert batch.random is not None
        if path is SamplingPath.FUSED:
            return self._fused_sample(logits, batch.random)
        return staged_sample(logits, batch.random, self.generator, self.chunk_bytes)

    def _fused_sample(self, logits: torch.Tensor, random: RandomSampling) -> torch.Tensor:
        """[N] int64 from the inverse-CDF kernels: random rows at their temperature, greedy rows at 0."""
        temperature = random.temperature  # [N] when every row draws at random
        if random.rows is not None:  # greedy rows too: temperature 0 for them
            temperature = torch.zeros(logits.shape[0], dtype=torch.float32, device=logits.device)
            temperature.index_copy_(0, random.rows, random.temperature)
        # The seed is drawn on the device, from the shared generator: no host sync, and reproducible
        # from the runner's seed as the staged path's noise is.
        seed = torch.randint(SEED_BOUND, (1,), generator=self.generator, device=logits.device)
        return cdf_sample(logits.contiguous(), temperature, seed)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor,
                        chunk_bytes: int | None = SAMPLER_CHUNK_BYTES) -> None:
    """-inf at every token a row's grammar forbids, in place. logits [N, V]; rows [G]; bitmask [G, W]
    int32 with W = ceil(V / 32). Plain torch (CPU and CUDA): shifts and ands, no compiled kernel; the
    grammar rows go through in chunks of `chunk_bytes` (None: all at once)."""
    vocab_size = logits.shape[1]
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)  # [32]
    for chunk in row_chunks(rows.shape[0], vocab_size, chunk_bytes):
        allowed = ((bitmask[chunk].unsqueeze(2) >> shifts) & 1).bool().flatten(1)[:, :vocab_size]  # [g, V]
        logits[rows[chunk]] = logits[rows[chunk]].masked_fill(~allowed, float("-inf"))


def raw_logprobs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor | None:
    """[N, V] log_softmax of the model's logits, if some row asked for logprobs (take it before `sample`)."""
    if batch.max_num_logprobs is None:
        return None
    # [N, V] float32 whatever the logits' dtype; a new tensor: later in-place edits don't touch it
    return torch.log_softmax(logits, dim=-1, dtype=torch.float32)


def apply_penalties(logits: torch.Tensor, penalties: PenaltyInputs,
                    chunk_bytes: int | None = SAMPLER_CHUNK_BYTES) -> None:
    """Repetition, frequency and presence penalties on the penalised rows of logits [N, V], in place, in
    chunks of `chunk_bytes` (None: all rows at once)."""
    for chunk in row_chunks(penalties.rows.shape[0], logits.shape[1], chunk_bytes):
        _penalize(logits, penalties, chunk)


def _penalize(logits: torch.Tensor, penalties: PenaltyInputs, chunk: slice) -> None:
    """`apply_penalties` on the penalised rows `chunk` (indices into penalties' M rows)."""
    vocab_size = logits.shape[1]
    logit_rows = penalties.rows[chunk]  # [m]
    rows = logits[logit_rows]  # [m, V] copy
    output_ids, prompt_ids = penalties.output_token_ids[chunk], penalties.prompt_token_ids[chunk]
    # Histories are padded with token id V: scatter into V + 1 columns, then drop the pad column.
    output_counts = torch.zeros(rows.shape[0], vocab_size + 1, dtype=logits.dtype, device=logits.device)
    output_counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=logits.dtype))
    output_counts = output_counts[:, :vocab_size]  # [m, V]
    in_prompt = torch.zeros(rows.shape[0], vocab_size + 1, dtype=torch.bool, device=logits.device)
    in_prompt.scatter_(1, prompt_ids, True)
    seen = in_prompt[:, :vocab_size] | (output_counts > 0)  # [m, V]
    repetition = penalties.repetition[chunk].unsqueeze(1)  # [m, 1]
    rows = torch.where(seen, torch.where(rows > 0, rows / repetition, rows * repetition), rows)
    rows -= penalties.frequency[chunk].unsqueeze(1) * output_counts
    rows -= penalties.presence[chunk].unsqueeze(1) * (output_counts > 0).to(logits.dtype)
    logits[logit_rows] = rows


def gather_logprobs(
    raw_logprobs: torch.Tensor, sampled: torch.Tensor, num_logprobs: list[int | None]
) -> list[TokenLogprobs | None]:
    """Sampled token's logprob and 1-based rank, plus each row's top-n, from raw logprobs [N, V]."""
    max_n = max(n for n in num_logprobs if n is not None)
    token_logprobs = raw_logprobs.gather(1, sampled.unsqueeze(1))  # [N, 1]
    ranks = (raw_logprobs >= token_logprobs).sum(dim=-1)  # [N]; counts the token itself (vLLM)
    top = raw_logprobs.topk(max_n, dim=-1) if max_n > 0 else None
    top_ids = top.indices.tolist() if top is not None else None
    top_values = top.values.tolist() if top is not None else None
    token_values, rank_values, sampled_ids = token_logprobs.squeeze(1).tolist(), ranks.tolist(), sampled.tolist()
    results: list[TokenLogprobs | None] = []
    for row, n in enumerate(num_logprobs):
        if n is None:
            results.append(None)
            continue
        results.append(TokenLogprobs(
            token_id=sampled_ids[row], logprob=token_values[row], rank=rank_values[row],
            top_token_ids=top_ids[row][:n] if top_ids is not None else [],
            top_logprobs=top_values[row][:n] if top_values is not None else [],
        ))
    return results
