"""The sampler's share of the memory plan: the peak of the engine's profiled sampler step.

The start-up memory profile runs one sampler step over every row a step can sample (max_num_seqs, or
the token budget if smaller), top-p 0.9 on the staged path, and reserves its peak out of the KV cache.
Since the staged path goes through the rows in chunks (worker/sampler_staged.py), that peak is what the
whole batch holds plus one chunk's temporaries: `sampler_bytes`. Before, the whole batch's temporaries
were live at once: `unchunked_sampler_bytes`, kept for the engine KV counts measured then.
"""

from __future__ import annotations

SAMPLER_BYTES_PER_LOGIT = 8
"""Bytes per (row, vocabulary entry) the sampler's profiled step holds for the whole batch: the float32
copy of the LM head's logits and the shared generator's exponential noise [rows, V] (top-p alone keeps
every token). Fitted with the two constants below to one sampler call's peak on an H200 (beyond the LM
head's bf16 logits; benchmarks/gpu/sampler_memory.py on this code, 2026-12-06): 0.5378 GiB at
256 × 128,256, 1.2684 GiB at 1,024 × 128,256, 0.5811 GiB at 256 × 151,936, 1.4503 GiB at 1,024 × 151,936
(docs/performance.md, "Sampler memory"); the model is within 0.2% of each. The engine's profile holds
both again (2026-12-07, branch samplermem): its requests edit their logits, as one penalised request of a
real full batch does, so the sampler makes the float32 copy; the LM head's bf16 logits are handed over and
freed once copied, so they are not counted here either (the stage's figure in the start-up line is this
plus ~0.03 GiB, the cuBLAS workspace the forward allocated: inferred, 32 MiB on Hopper)."""
SAMPLER_STAGED_BYTES_PER_LOGIT = 48
"""Bytes per logit of the staged path's temporaries (scaled copy, top-p's full sort: values and int64
ids, softmax, cumulative sum, masks) -- for the rows of one chunk only (worker/sampler_staged.py). A whole
batch in one pass peaks at 8 + 48 = 56 bytes per logit (measured: 56.0 on the H200)."""
SAMPLER_CHUNK_PEAK_BYTES = 315_000_000
"""The staged temporaries' peak once the rows go through in chunks: 311-315 MB measured at both
vocabularies, against the 250 MB budget (`SAMPLER_CHUNK_BYTES`) the chunk's rows are sized by. The
~63 MB above the budget is constant across vocabularies and row counts, so part of one chunk's
temporaries is still live while the next one's are made."""
UNCHUNKED_SAMPLER_BYTES_PER_LOGIT = 52
"""Historical: the whole-batch sampler's reserve before the staged path went through row chunks (H100,
Qwen3-32B shape: the KV budget at max_num_seqs 1024 was 5,792 MiB below that at 256, i.e. 52.0 bytes for
each of the 768 × 151,936 extra logits; one call on bf16 logits peaked at 56: the same plus the float32
copy, which that profile made before the call). The engine KV counts measured with that sampler are
checked against it (tests/bench/plan/test_plan_vs_gpu.py)."""


def sampler_bytes(rows: int, vocab_size: int) -> int:
    """Peak bytes of one profiled sampler step over `rows` rows of `vocab_size` logits: what the whole
    batch holds, plus the staged temporaries of one chunk (all rows' when they fit in one)."""
    logits = rows * vocab_size
    return logits * SAMPLER_BYTES_PER_LOGIT + min(logits * SAMPLER_STAGED_BYTES_PER_LOGIT, SAMPLER_CHUNK_PEAK_BYTES)


def unchunked_sampler_bytes(rows: int, vocab_size: int) -> int:
    """Historical: the whole-batch sampler's peak (`UNCHUNKED_SAMPLER_BYTES_PER_LOGIT`)."""
    return rows * vocab_size * UNCHUNKED_SAMPLER_BYTES_PER_LOGIT
