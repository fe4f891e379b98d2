"""The torch attention backend over an FP8 KV cache (CPU): it writes the bits the store reference
writes, reads them as the kernels' reference does, and an `Attention` layer with its `KVScales` stays
within the format's bound of the same layer over a float32 cache."""

from __future__ import annotations

import pytest
import torch

from conveyor.kernels.fp8_kv import KVScales, quantize_kv
from conveyor.kernels.paged_batch import PagedBatch, paged_attention_ref
from conveyor.kernels.store_kv import store_kv_ref
from conveyor.model.attention import (
    Attention,
    TorchAttentionBackend,
    kv_cache_shape,
    write_kv_torch,
)
from conveyor.model.attention_metadata import (
    AttentionMetadata,
    SequenceSpec,
    build_attention_metadata,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SCALES = KVScales(k_scale=0.5, v_scale=0.25)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_write_kv_torch_writes_the_store_references_bits(dtype: torch.dtype) -> None:
    kv_cache = torch.zeros(kv_cache_shape(4, 2, 3, 8), dtype=dtype)  # [2, nb, bs, kvh, d]
    expected = torch.zeros(kv_cache_shape(4, 2, 3, 8), dtype=dtype)
    key, value = torch.randn(3, 3, 8) * 5, torch.randn(3, 3, 8)
    slots = torch.tensor([5, 0, 6])
    write_kv_torch(key, value, kv_cache, slots, SCALES)
    store_kv_ref(key, value, expected[0], expected[1], slots, scales=SCALES)
    assert torch.equal(kv_cache.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(kv_cache[0, 2, 1].view(torch.uint8), quantize_kv(key[0], dtype, 0.5).view(torch.uint8))


def paged_batch_of(metadata: AttentionMetadata) -> PagedBatch:
    return PagedBatch(block_tables=metadata.block_tables, seq_lens=metadata.seq_lens,
                      query_start_loc=metadata.query_start_loc, max_query_len=metadata.max_query_len,
                      max_seq_len=metadata.max_seq_len)


def run_layer(cache_dtype: torch.dtype, scales: KVScales) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """One step (a decode after 29 cached tokens, a 6-token chunk after 3) through an Attention layer
    whose context was written by the same backend; returns (output [T, H*d], the cache, metadata)."""
    gen = torch.Generator().manual_seed(5)
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 32, 4
    specs = [SequenceSpec(1, 30, [9, 2, 7, 0, 4, 11, 5, 1]), SequenceSpec(6, 9, [3, 8, 6])]
    kv_cache = torch.zeros(kv_cache_shape(12, block_size, num_kv_heads, head_dim), dtype=cache_dtype)
    backend = TorchAttentionBackend()
    for spec in specs:  # the cached context, through the backend's own write
        cached = spec.seq_len - spec.num_query_tokens
        context = build_attention_metadata([SequenceSpec(cached, cached, spec.block_ids)], block_size, "cpu")
        keys = torch.randn(cached, num_kv_heads, head_dim, generator=gen)
        backend.write_kv(keys, torch.randn(cached, num_kv_heads, head_dim, generator=gen), kv_cache,
                         context.slot_mapping, scales)
    metadata = build_attention_metadata(specs, block_size, "cpu")
    layer = Attention(num_heads, num_kv_heads, head_dim, backend, kv_scales=scales)
    q = torch.randn(metadata.num_tokens, num_heads * head_dim, generator=gen)  # [T, H*d]
    k, v = (torch.randn(metadata.num_tokens, num_kv_heads * head_dim, generator=gen) for _ in range(2))
    return layer(q, k, v, kv_cache, metadata), kv_cache, metadata


@pytest.mark.parametrize(("dtype", "bound"), [(E4M3, 2.0**-4), (E5M2, 2.0**-3)])
def test_attention_layer_over_fp8_kv(dtype: torch.dtype, bound: float) -> None:
    out, kv_cache, metadata = run_layer(dtype, SCALES)
    full, _, _ = run_layer(torch.float32, SCALES)
    assert 0 < float((out - full).norm() / full.norm()) <= bound
    # The backend read the cache exactly as the kernels' reference reads it.
    query = torch.randn(metadata.num_tokens, 8, 32, generator=torch.Generator().manual_seed(5))
    metadata.backend_plan = None
    backend_out = TorchAttentionBackend().forward(query, kv_cache, metadata, 32**-0.5, SCALES)
    reference = paged_attention_ref(query, kv_cache[0], kv_cache[1], paged_batch_of(metadata), 32**-0.5,
                                    kv_scales=SCALES)
    torch.testing.assert_close(backend_out, reference, atol=1e-5, rtol=1e-4)
