"""A minimal paged driver for model tests: greedy decoding of several prompts in mixed batches.

Each step computes, for every unfinished sequence, either the next prompt chunk (at most
`chunk_size` tokens, attending to the chunks already cached) or one decode token, all in one
flat batch through `AttentionMetadata` — the same path the worker takes, without the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from conveyor.model.attention import kv_cache_shape
from conveyor.model.attention_metadata import SequenceSpec, build_attention_metadata


@dataclass
class _Seq:
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed: int = 0
    sampled_logits: list[torch.Tensor] = field(default_factory=list)


def allocate_kv_caches(model: torch.nn.Module, num_blocks: int, block_size: int) -> list[torch.Tensor]:
    shape = kv_cache_shape(num_blocks, block_size, model.num_kv_heads, model.head_dim)
    return [torch.zeros(shape, dtype=model.dtype) for _ in range(model.num_layers)]


def greedy_generate(
    model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int, chunk_size: int = 8,
    block_size: int = 4,
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """(new token ids per prompt, [max_new_tokens, vocab] logits per prompt)."""
    max_len = max(len(p) for p in prompts) + max_new_tokens
    blocks_per_seq = -(-max_len // block_size)
    # Interleaved, non-contiguous block ids so that the block table really matters.
    num_blocks = blocks_per_seq * len(prompts) + 1
    seqs = [
        _Seq(list(p), len(p), [1 + i + j * len(prompts) for j in range(blocks_per_seq)])
        for i, p in enumerate(prompts)
    ]
    kv_caches = allocate_kv_caches(model, num_blocks, block_size)
    while any(len(s.token_ids) < s.num_prompt_tokens + max_new_tokens for s in seqs):
        _step(model, [s for s in seqs if len(s.token_ids) < s.num_prompt_tokens + max_new_tokens],
              kv_caches, chunk_size, block_size)
    return ([s.token_ids[s.num_prompt_tokens:] for s in seqs], [torch.stack(s.sampled_logits) for s in seqs])


def _step(model, seqs: list[_Seq], kv_caches, chunk_size: int, block_size: int) -> None:
    specs, input_ids, positions = [], [], []
    for s in seqs:
        num_new = min(chunk_size, len(s.token_ids) - s.num_computed)
        start = s.num_computed
        input_ids += s.token_ids[start : start + num_new]
        positions += range(start, start + num_new)
        specs.append(SequenceSpec(num_new, start + num_new, s.block_ids))
    metadata = build_attention_metadata(specs, block_size, "cpu")
    with torch.no_grad():
        hidden = model(torch.tensor(input_ids), torch.tensor(positions), kv_caches, metadata)
    last_rows = metadata.query_start_loc[1:].long() - 1
    logits = model.compute_logits(hidden[last_rows])  # [num_seqs, vocab]
    for s, spec, row in zip(seqs, specs, logits):
        s.num_computed = spec.seq_len
        if s.num_computed == len(s.token_ids):  # the chunk reached the end: sample
            s.sampled_logits.append(row)
            s.token_ids.append(int(row.argmax()))
