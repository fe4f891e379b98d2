"""The torch and cpu paged-attention backends equal dense causal attention computed per sequence."""

from __future__ import annotations

import pytest
import torch

from conveyor.model.attention import (
    Attention, TorchAttentionBackend, get_attention_backend, kv_cache_shape,
    write_kv_torch,
)
from conveyor.model.attention_metadata import SequenceSpec, build_attention_metadata, positions_of


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [q, H, d] = the last q positions of a sequence whose k/v are [L, kvh, d] -> [q, H, d]."""
    num_queries, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)  # [L, H, d]
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [H, q, L]
    query_pos = torch.arange(seq_len - num_queries, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > query_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_mixed_batch(specs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
                    block_size: int, backend: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """(paged output, dense reference) for sequences given as (num_query_tokens, seq_len)."""
    gen = torch.Generator().manual_seed(sum(q * 31 + s for q, s in specs) + num_heads)
    blocks_needed = [-(-s // block_size) for _, s in specs]
    num_blocks = sum(blocks_needed) + 3
    free = torch.randperm(num_blocks, generator=gen).tolist()  # scattered block ids
    seqs = []
    for (num_q, seq_len), n in zip(specs, blocks_needed):
        seqs.append(SequenceSpec(num_q, seq_len, [free.pop() for _ in range(n)]))
    metadata = build_attention_metadata(seqs, block_size, "cpu")
    kv_cache = torch.randn(kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim), generator=gen)
    full_k = [torch.randn(s, num_kv_heads, head_dim, generator=gen) for _, s in specs]
    full_v = [torch.randn(s, num_kv_heads, head_dim, generator=gen) for _, s in specs]
    # The cached context goes in through the same slot arithmetic, then this step's tokens via write_kv.
    for seq, k, v in zip(seqs, full_k, full_v):
        context = build_attention_metadata([SequenceSpec(seq.seq_len, seq.seq_len, seq.block_ids)], block_size, "cpu")
        write_kv_torch(k, v, kv_cache, context.slot_mapping)
    query = torch.randn(metadata.num_tokens, num_heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    out = get_attention_backend(backend).forward(query, kv_cache, metadata, scale)
    starts = metadata.query_start_loc.tolist()
    reference = torch.cat([
        dense_attention(query[starts[i]:starts[i + 1]], full_k[i], full_v[i], scale) for i in range(len(specs))
    ])
    return out, reference


@pytest.mark.parametrize(
    ("specs", "num_heads", "num_kv_heads", "head_dim", "block_size"),
    [
        ([(5, 5)], 4, 4, 16, 4),  # one plain prefill (MHA)
        ([(1, 9), (1, 1), (1, 33)], 8, 2, 32, 8),  # decodes only, GQA
        ([(7, 20), (1, 13), (12, 12), (1, 40), (3, 3)], 9, 3, 64, 4),  # SmolLM2-like mixed batch
        ([(16, 64), (1, 17), (2, 2)], 6, 1, 8, 16),  # MQA, chunk with a cached prefix
        ([(1, 300), (4, 40), (1, 1), (1, 77)], 4, 2, 32, 32),  # long decode across many blocks
        # speculative verify steps (1 + K tokens after a context) beside decodes; 8 and 9 tokens: either
        # side of the cpu backend's MAX_QUERY_TOKENS (its decode kernel vs its prefill kernel)
        ([(4, 400), (4, 37), (1, 50), (8, 8), (9, 30), (2, 17)], 9, 3, 64, 16),
        # prefill chunks over several query tiles and blocks, one after 150 cached tokens
        ([(100, 250), (1, 60), (40, 40), (33, 33)], 9, 3, 64, 16),
    ],
)
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_mixed_batch_matches_dense_reference(specs, num_heads, num_kv_heads, head_dim, block_size, backend) -> None:
    out, reference = run_mixed_batch(specs, num_heads, num_kv_heads, head_dim, block_size, backend)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-4)


def test_write_kv_lands_in_the_mapped_slots() -> None:
    kv_cache = torch.zeros(kv_cache_shape(4, 2, 1, 3))
    key = torch.arange(6.0).view(2, 1, 3)
    write_kv_torch(key, -key, kv_cache, torch.tensor([5, 0]))
    assert torch.equal(kv_cache[0, 2, 1, 0], key[0, 0]) and torch.equal(kv_cache[1, 0, 0, 0], -key[1, 0])
    assert kv_cache.abs().sum() == 2 * key.sum()


def test_attention_module_writes_then_attends() -> None:
    attn = Attention(num_heads=4, num_kv_heads=2, head_dim=8, backend=TorchAttentionBackend())
    metadata = build_attention_metadata([SequenceSpec(3, 3, [1])], block_size=4, device="cpu")
    kv_cache = torch.zeros(kv_cache_shape(2, 4, 2, 8))
    q, k, v = torch.randn(3, 32), torch.randn(3, 16), torch.randn(3, 16)
    out = attn(q, k, v, kv_cache, metadata)
    reference = dense_attention(q.view(3, 4, 8), k.view(3, 2, 8), v.view(3, 2, 8), 8**-0.5)
    torch.testing.assert_close(out, reference.reshape(3, 32), atol=1e-5, rtol=1e-4)


def test_metadata_geometry() -> None:
    metadata = build_attention_metadata(
        [SequenceSpec(2, 6, [7, 3]), SequenceSpec(1, 1, [5])], block_size=4, device="cpu"
    )
    assert metadata.query_start_loc.tolist() == [0, 2, 3]
    assert metadata.slot_mapping.tolist() == [3 * 4 + 0, 3 * 4 + 1, 5 * 4 + 0]
    assert metadata.block_tables.tolist() == [[7, 3], [5, 0]]
    assert positions_of(metadata).tolist() == [4, 5, 0]
    assert (metadata.num_decode_tokens, metadata.num_prefills, metadata.max_seq_len) == (1, 1, 6)


def test_metadata_rejects_too_few_blocks() -> None:
    with pytest.raises(ValueError, match="cannot hold"):
        build_attention_metadata([SequenceSpec(5, 5, [0])], block_size=4, device="cpu")


def test_backend_factory() -> None:
    assert get_attention_backend("torch").name == "torch"
    assert get_attention_backend("cpu").name == "cpu"
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        get_attention_backend("flash")


def test_decodes_split_into_length_groups_still_match(monkeypatch: pytest.MonkeyPatch) -> None:
    from conveyor.model import attention

    monkeypatch.setattr(attention, "DECODE_GROUP_BYTES", 2 * 2 * 16 * 4 * 40)  # ~40 tokens of K+V per group
    specs = [(1, 5), (1, 37), (1, 12), (4, 9), (1, 30), (1, 2), (1, 19)]
    out, reference = run_mixed_batch(specs, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-4)


def test_cpu_backend_rejects_a_non_float32_cache() -> None:
    metadata = build_attention_metadata([SequenceSpec(1, 3, [0])], 4, "cpu")
    kv_cache = torch.zeros(kv_cache_shape(1, 4, 1, 16), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="float32 CPU KV cache"):
        get_attention_backend("cpu").forward(torch.zeros(1, 1, 16, dtype=torch.bfloat16), kv_cache, metadata, 0.25)
