"""Triton kernels against their float32 references on fresh random inputs of many shapes (CUDA only)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from kernel_fixtures import Shape, make_case, relative_error

from conveyor.kernels.paged_batch import PagedBatch, paged_attention_ref
from conveyor.kernels.split_kv_attention import SplitKVParams, split_kv_attention, split_kv_attention_ref
from conveyor.kernels.store_kv import store_kv, store_kv_ref
from conveyor.kernels.triton_compat import HAS_TRITON
from conveyor.kernels.unified_attention import decode_order_of, unified_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and Triton"),
]
TOLERANCE = 1e-2
HEADS = [(8, 8), (16, 4), (32, 8), (32, 4), (16, 2)]  # (query heads, kv heads): GQA 1, 4, 4, 8, 8


def _shapes() -> list[Shape]:
    rng = random.Random(7)
    shapes = []
    for (heads, kv_heads), head_dim, block_size in itertools.product(HEADS, (64, 128), (16, 32)):
        num_seqs = rng.randint(1, 6)
        query_lens = tuple(rng.choice([1, 1, rng.randint(2, 70)]) for _ in range(num_seqs))
        context_lens = tuple(rng.choice([0, rng.randint(1, 300)]) for _ in range(num_seqs))
        shapes.append(Shape(heads, kv_heads, head_dim, block_size, query_lens, context_lens))
    shapes.append(Shape(32, 8, 128, 16, query_lens=(1,) * 64, context_lens=tuple(range(0, 4096, 64))))
    shapes.append(Shape(16, 8, 128, 16, query_lens=(1, 2048, 1), context_lens=(3000, 0, 70)))
    shapes.append(Shape(32, 8, 128, 32, query_lens=(512, 1), context_lens=(1500, 8000)))
    # head_dim below its power of two (the padded lanes are masked in the unmasked loop too)
    shapes.append(Shape(8, 2, 80, 16, query_lens=(1, 37, 1, 200), context_lens=(40, 0, 130, 77)))
    return shapes


def _id(shape: Shape) -> str:
    return f"h{shape.num_heads}kv{shape.num_kv_heads}d{shape.head_dim}b{shape.block_size}n{len(shape.query_lens)}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", _shapes(), ids=_id)
def test_unified_attention_matches_reference(shape: Shape, dtype: torch.dtype) -> None:
    case = make_case(shape, dtype=dtype, device="cuda", seed=hash(shape) % 1000)
    scale = shape.head_dim**-0.5
    out = unified_attention(case.query, case.key_cache, case.value_cache, case.batch, scale)
    ref = paged_attention_ref(case.query, case.key_cache, case.value_cache, case.batch, scale)
    assert not out.isnan().any()
    assert relative_error(out, ref) <= TOLERANCE


@pytest.mark.parametrize("shape", _shapes()[::3], ids=_id)
def test_unified_attention_with_a_decode_order_matches_reference(shape: Shape) -> None:
    """The triton backend's launch: decode programs longest first (DECODE_ORDER_NOTE)."""
    case = make_case(shape, dtype=torch.bfloat16, device="cuda", seed=hash(shape) % 1000 + 1)
    scale = shape.head_dim**-0.5
    order = decode_order_of(case.batch.seq_lens)
    out = unified_attention(case.query, case.key_cache, case.value_cache, case.batch, scale, decode_order=order)
    ref = paged_attention_ref(case.query, case.key_cache, case.value_cache, case.batch, scale)
    assert not out.isnan().any()
    assert relative_error(out, ref) <= TOLERANCE


@pytest.mark.parametrize("num_splits", [1, 3, 8, 32])
@pytest.mark.parametrize("heads", HEADS)
def test_split_kv_matches_reference(heads: tuple[int, int], num_splits: int) -> None:
    context_lens = (0, 15, 700, 5000)
    shape = Shape(heads[0], heads[1], 128, 16, query_lens=(1,) * 4, context_lens=context_lens)
    case = make_case(shape, dtype=torch.bfloat16, device="cuda", seed=num_splits)
    params = SplitKVParams(scale=128**-0.5, num_splits=num_splits)
    out = split_kv_attention(case.query, case.key_cache, case.value_cache, case.batch, params)
    ref = split_kv_attention_ref(case.query, case.key_cache, case.value_cache, case.batch, params)
    assert relative_error(out, ref) <= TOLERANCE
    full = paged_attention_ref(case.query, case.key_cache, case.value_cache, case.batch, params.scale)
    assert relative_error(out, full) <= TOLERANCE


def test_padding_sequences_write_zeros_and_no_kv() -> None:
    case = make_case(Shape(16, 4, 128, 16, query_lens=(1, 1, 1), context_lens=(40, 9, 0)), torch.bfloat16, "cuda")
    seq_lens = case.batch.seq_lens.clone()
    seq_lens[2] = 0
    batch = PagedBatch(case.batch.block_tables, seq_lens, case.batch.query_start_loc, 1, 41)
    for out in (unified_attention(case.query, case.key_cache, case.value_cache, batch, 0.1),
                split_kv_attention(case.query, case.key_cache, case.value_cache, batch, SplitKVParams(0.1, 4))):
        assert torch.all(out[2] == 0)
        ref = paged_attention_ref(case.query, case.key_cache, case.value_cache, batch, 0.1)
        assert relative_error(out[:2], ref[:2]) <= TOLERANCE



def test_graph_padding_sequence_reads_no_block_table() -> None:
    """A mixed CUDA graph's padding sequence: seq_len 0, hundreds of query tokens (so context_len is
    very negative) and a stale block-table row. Its outputs are zeros and no program reads that row --
    here the row holds block ids far outside the cache, so a read would be an illegal address."""
    case = make_case(Shape(32, 8, 128, 16, query_lens=(1, 200, 300), context_lens=(50, 70, 0)), torch.bfloat16,
                     "cuda")
    seq_lens = case.batch.seq_lens.clone()
    seq_lens[2] = 0
    tables = case.batch.block_tables.clone()
    tables[2] = 2**30
    batch = PagedBatch(tables, seq_lens, case.batch.query_start_loc, 300, 270)
    out = unified_attention(case.query, case.key_cache, case.value_cache, batch, 0.1)
    torch.cuda.synchronize()
    assert torch.all(out[201:] == 0)
    ref = paged_attention_ref(case.query, case.key_cache, case.value_cache, batch, 0.1)
    assert relative_error(out[:201], ref[:201]) <= TOLERANCE


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_store_kv_matches_reference(dtype: torch.dtype) -> None:
    num_tokens, kv_heads, head_dim = 300, 8, 128
    qkv = torch.randn(num_tokens, 48, head_dim, device="cuda").to(dtype)  # strided K/V views
    key, value = qkv[:, 32:40], qkv[:, 40:48]
    slots = torch.randperm(64 * 16, device="cuda")[:num_tokens]
    slots[::7] = -1
    caches = [torch.randn(64, 16, kv_heads, head_dim, device="cuda").to(dtype) for _ in range(2)]
    caches += [cache.clone() for cache in caches]
    store_kv(key, value, caches[0], caches[1], slots)
    store_kv_ref(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("heads", [(32, 8), (16, 8), (64, 2)])
def test_mixed_batch_split_launches_equal_one_launch(heads: tuple[int, int]) -> None:
    """A mixed batch runs as two launches (one-token sequences with the decode tile, the rest with 64-row
    blocks): every token is written once, and the result is the single launch's, decodes first or last."""
    from conveyor.kernels.unified_attention import decode_order_of, unified_attention_with_tile, unified_tile

    query_lens = (1,) * 40 + (300,) + (1,) * 9 + (17,)
    context_lens = tuple(random.Random(3).randint(0, 900) for _ in query_lens)
    case = make_case(Shape(heads[0], heads[1], 128, 16, query_lens, context_lens), torch.bfloat16, "cuda", seed=5)
    split = unified_attention(case.query, case.key_cache, case.value_cache, case.batch, 0.09)
    one = unified_attention_with_tile(case.query, (case.key_cache, case.value_cache), case.batch, 0.09,
                                      unified_tile(300, heads[0] // heads[1]))
    ref = paged_attention_ref(case.query, case.key_cache, case.value_cache, case.batch, 0.09)
    assert relative_error(split, ref) <= TOLERANCE
    assert relative_error(split, one) <= TOLERANCE
