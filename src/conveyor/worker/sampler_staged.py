"""The sampler's staged path in row chunks: temperature, min-p, top-k / top-p, then the exponential race.

Every stage of the staged path works row by row, and each allocates [rows, V] float32 (and int64)
temporaries: the temperature-scaled copy, min-p's probabilities, top-k's values and token ids (the whole
vocabulary, sorted, under top-p alone), top-p's softmax and cumulative sum, the final softmax. Over a whole
batch of 1,024 rows × 151,936 tokens those temporaries peaked at 8.1 GiB on an H100, and the start-up
memory profile reserved all of it, out of the KV cache. Here the rows go through in chunks of
`rows_per_chunk` rows, so the temporaries of one chunk are bounded by a byte budget
(`SAMPLER_CHUNK_BYTES`); what the whole batch needs stays whole: the shared generator's exponential noise
[R, K], drawn in one call exactly as the unchunked path draws it, and the float32 logits where edits
(penalties, grammar, bias) need them -- without edits the LM head's bf16 logits are read chunk by chunk. Every
stage is row-wise, so the tokens are the same, chunked or not: a seeded row draws its own noise from
its own generator inside its chunk, and unseeded rows read the one shared draw by row.
"""

from __future__ import annotations

import torch

from conveyor.worker.sampling_metadata import RandomSampling

SAMPLER_CHUNK_BYTES = 250_000_000
"""Byte budget of one chunk's staged temporaries (~250 MB: rows × V × STAGED_BYTES_PER_LOGIT at most,
one row whatever the budget). 34 rows of a 151,936-token vocabulary, 40 of 128,256."""
STAGED_BYTES_PER_LOGIT = 48
"""Bytes per (row, token) of the staged path's temporaries, counted generously: the gathered rows and the
scaled copy (4 + 4), top-k's values and int64 ids over the whole vocabulary (4 + 8) with the sort's
workspace, top-p's softmax, cumulative sum and mass (4 + 4 + 4), masks, the final softmax; the
penalties' counts, histories and `where`s fit under it too. On an H100 the unchunked path peaked at
~48 B/logit above the persistent 8 (docs/performance.md, "Sampler memory")."""


def rows_per_chunk(vocab_size: int, chunk_bytes: int | None, bytes_per_logit: int = STAGED_BYTES_PER_LOGIT) -> int | None:
    """Rows whose temporaries fit in `chunk_bytes` (at least 1); None: no chunking (one chunk)."""
    if chunk_bytes is None:
        return None
    return max(1, chunk_bytes // (vocab_size * bytes_per_logit))


def row_chunks(num_rows: int, vocab_size: int, chunk_bytes: int | None) -> list[slice]:
    """Consecutive slices covering range(num_rows), each of at most `rows_per_chunk` rows."""
    step = rows_per_chunk(vocab_size, chunk_bytes) or max(num_rows, 1)
    return [slice(start, min(start + step, num_rows)) for start in range(0, num_rows, step)]


def staged_sample(logits: torch.Tensor, random: RandomSampling, shared: torch.Generator,
                  chunk_bytes: int | None = SAMPLER_CHUNK_BYTES) -> torch.Tensor:
    """[N] int64 by the staged path: argmax for greedy rows, a draw for the others (only they pay for
    it); logits [N, V] float32 or the LM head's 16-bit dtype (each chunk is promoted to float32 as it is
    scaled, exactly: the same tokens as from a float32 copy), not modified; `shared` draws the noise of rows without their own
    generator; the random rows go through in chunks of `chunk_bytes` (None: all at once)."""
    num_random, vocab_size = random.temperature.shape[0], logits.shape[1]
    noise = shared_noise(random, logits.device, shared)  # [R, K] float32
    drawn = torch.empty(num_random, dtype=torch.int64, device=logits.device)  # [R]
    for rows in row_chunks(num_random, vocab_size, chunk_bytes):
        drawn[rows] = draw_chunk(logits, random, rows, noise[rows])
    if random.rows is None:
        return drawn
    sampled = logits.argmax(dim=-1)  # [N]
    sampled[random.rows] = drawn
    return sampled


def shared_noise(random: RandomSampling, device: torch.device, shared: torch.Generator) -> torch.Tensor:
    """[R, K] Exp(1) noise of the whole batch, K = max_top_k, from the shared generator in one call (as
    the unchunked path always drew it), unless every row has its own generator."""
    noise = torch.empty(random.temperature.shape[0], random.max_top_k, device=device)  # [R, K] float32
    if len(random.generators) < noise.shape[0]:
        noise.exponential_(generator=shared)
    return noise


def draw_chunk(logits: torch.Tensor, random: RandomSampling, rows: slice, noise: torch.Tensor) -> torch.Tensor:
    """[r] token ids of the random rows `rows` (indices into 0..R-1); noise [r, K]: their slice of the
    shared noise, a view (a seeded row's own noise is written into it)."""
    chosen = logits[rows] if random.rows is None else logits[random.rows[rows]]  # [r, V]
    # A new float32 tensor (temperature is float32, so bf16 rows are promoted exactly): edits below stay local.
    scaled = chosen / random.temperature[rows].unsqueeze(1)
    del chosen
    if random.min_p is not None:
        apply_min_p(scaled, random.min_p[rows])
    candidates = None
    if random.top_k is not None or random.top_p is not None:
        top_k = random.top_k[rows] if random.top_k is not None else None
        top_p = random.top_p[rows] if random.top_p is not None else None
        scaled, candidates = top_k_top_p_candidates(scaled, top_k, top_p, random.max_top_k)
    probs = scaled.softmax(dim=-1)  # [r, K]
    del scaled
    generators = {index - rows.start: generator for index, generator in random.generators.items()
                  if rows.start <= index < rows.stop}
    return exponential_race(probs, candidates, logits.shape[1], generators, noise)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drop tokens whose probability is below min_p × the top token's, in place. logits [N, V]."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [N, 1]
    logits.masked_fill_(probs < threshold, float("-inf"))


def top_k_top_p_candidates(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, max_top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's best max_top_k tokens, descending, with those past the row's k or its top-p set to -inf.

    logits [R, V] -> (values [R, K], token ids [R, K]). With top_k = 50 this is a top-k of 50 instead
    of a sort of the whole vocabulary; top-p alone needs the full sort (K = V).
    """
    values, token_ids = logits.topk(max_top_k, dim=-1)  # [R, K], sorted descending
    if top_k is not None:
        ranks = torch.arange(max_top_k, device=logits.device)
        values = values.masked_fill(ranks.unsqueeze(0) >= top_k.unsqueeze(1), float("-inf"))
    if top_p is not None:
        probs = values.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens; 0 for the best one
        values = values.masked_fill(mass_before >= top_p.unsqueeze(1), float("-inf"))
    return values, token_ids


def exponential_race(
    probs: torch.Tensor, candidates: torch.Tensor | None, vocab_size: int,
    generators: dict[int, torch.Generator], noise: torch.Tensor,
) -> torch.Tensor:
    """argmax(p / q), q ~ Exp(1): a categorical draw per row; returns [R] token ids.

    probs [R, K] over the tokens `candidates` [R, K] (None: K = V, column = token id); noise [R, K]: the
    shared generator's draw, overwritten here for the rows of `generators` (row -> its own generator).
    A seeded row draws q for the whole vocabulary and reads it by token id, so its draw does not depend
    on how many candidates this batch kept (another row's top_k can change K).
    """
    for row, generator in generators.items():
        if candidates is None:
            noise[row].exponential_(generator=generator)
            continue
        vocab_noise = torch.empty(vocab_size, device=probs.device).exponential_(generator=generator)
        noise[row] = vocab_noise[candidates[row]]
    chosen = probs.div_(noise).argmax(dim=-1)  # [R]
    if candidates is None:
        return chosen
    return candidates.gather(1, chosen.unsqueeze(1)).squeeze(1)
