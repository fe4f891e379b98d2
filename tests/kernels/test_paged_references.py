"""The float32 references of the attention kernels agree with naive dense attention (CPU, no Triton)."""

from __future__ import annotations

import pytest
import torch
from kernel_fixtures import Shape, dense_attention, make_case, relative_error

from conveyor.kernels.split_kv_attention import SplitKVParams, choose_num_splits, split_kv_attention_ref
from conveyor.kernels.unified_attention import decode_tile, unified_attention_ref, unified_tile

MIXED = [
    Shape(4, 4, 64, 16, query_lens=(1, 7, 1, 33), context_lens=(5, 0, 40, 17)),
    Shape(8, 2, 32, 16, query_lens=(12,), context_lens=(0,)),
    Shape(16, 2, 64, 32, query_lens=(1, 1, 1), context_lens=(0, 31, 100)),
    Shape(8, 1, 16, 16, query_lens=(20, 1), context_lens=(35, 63)),
]


@pytest.mark.parametrize("shape", MIXED)
def test_unified_reference_matches_dense(shape: Shape) -> None:
    case = make_case(shape, seed=1)
    scale = shape.head_dim**-0.5
    out = unified_attention_ref(case.query, case.key_cache, case.value_cache, case.batch, scale)
    assert relative_error(out, dense_attention(case, scale)) < 1e-5


@pytest.mark.parametrize("num_splits", [1, 2, 3, 8])
def test_split_reference_matches_dense(num_splits: int) -> None:
    shape = Shape(8, 2, 64, 16, query_lens=(1, 1, 1, 1), context_lens=(0, 64, 200, 517))
    case = make_case(shape, seed=2)
    params = SplitKVParams(scale=0.125, num_splits=num_splits)
    out = split_kv_attention_ref(case.query, case.key_cache, case.value_cache, case.batch, params)
    assert relative_error(out, dense_attention(case, 0.125)) < 1e-5


def test_unified_reference_matches_model_torch_backend() -> None:
    attention = pytest.importorskip("conveyor.model.attention")
    shape = Shape(8, 4, 32, 16, query_lens=(1, 9, 1), context_lens=(12, 20, 0))
    case = make_case(shape, seed=3)
    kv_cache = torch.stack([case.key_cache, case.value_cache])
    metadata = _model_metadata(case, shape)
    expected = attention.paged_attention_torch(case.query, kv_cache, metadata, 0.2)
    out = unified_attention_ref(case.query, case.key_cache, case.value_cache, case.batch, 0.2)
    assert relative_error(out, expected) < 1e-5


def _model_metadata(case, shape: Shape):
    from conveyor.model.attention_metadata import AttentionMetadata

    seq_lens = case.batch.seq_lens.tolist()
    return AttentionMetadata(
        query_start_loc=case.batch.query_start_loc, seq_lens=case.batch.seq_lens,
        block_tables=case.batch.block_tables, slot_mapping=torch.zeros(0, dtype=torch.int64),
        max_query_len=case.batch.max_query_len, max_seq_len=case.batch.max_seq_len,
        query_lens_cpu=list(shape.query_lens), seq_lens_cpu=seq_lens, block_size=shape.block_size,
    )


def test_padding_sequence_gives_zeros() -> None:
    case = make_case(Shape(4, 2, 16, 16, query_lens=(1, 1), context_lens=(10, 0)), seed=4)
    seq_lens = case.batch.seq_lens.clone()
    seq_lens[1] = 0  # a CUDA-graph padding sequence
    batch = type(case.batch)(case.batch.block_tables, seq_lens, case.batch.query_start_loc, 1, 11)
    out = unified_attention_ref(case.query, case.key_cache, case.value_cache, batch, 0.25)
    assert torch.all(out[1] == 0)
    split = split_kv_attention_ref(case.query, case.key_cache, case.value_cache, batch, SplitKVParams(0.25, 2))
    assert torch.all(split[1] == 0) and relative_error(split[0], out[0]) < 1e-5


def test_tile_shapes_pack_the_group() -> None:
    decode, prefill = unified_tile(max_query_len=1, group=4), unified_tile(max_query_len=100, group=4)
    assert (decode.block_q, decode.block_m) == (4, 16) and (prefill.block_q, prefill.block_m) == (16, 64)
    assert unified_tile(max_query_len=1, group=32).block_m == 32


def test_the_decode_tile_of_a_mixed_batch_holds_one_token() -> None:
    """The one-token launch of a mixed batch: one token x the group's heads, at least tl.dot's 16 rows."""
    assert (decode_tile(4).block_q, decode_tile(4).block_m) == (1, 16)
    assert (decode_tile(32).block_q, decode_tile(32).block_m) == (1, 32)


def test_an_fp8_cache_doubles_the_decode_tiles_keys_for_the_same_bytes() -> None:
    assert unified_tile(1, 4).tile_n == decode_tile(4).tile_n == 64
    assert unified_tile(1, 4, kv_element_size=1).tile_n == decode_tile(4, kv_element_size=1).tile_n == 128
    assert unified_tile(100, 4, kv_element_size=1).tile_n == 64  # prefill blocks are compute-bound: unchanged


def test_an_fp8_decode_tile_keeps_three_stages_in_flight() -> None:
    assert unified_tile(1, 4, kv_element_size=1).num_stages == decode_tile(4, kv_element_size=1).num_stages == 3
    assert unified_tile(1, 4).num_stages == decode_tile(4).num_stages == 2  # 16-bit: as tuned before
    assert unified_tile(100, 4, kv_element_size=1).num_stages == 2


def test_num_splits_fill_the_gpu_only_when_needed() -> None:
    assert choose_num_splits(num_seqs=256, num_kv_heads=8, max_seq_len=2048, num_sms=132) == 1
    assert choose_num_splits(num_seqs=2, num_kv_heads=8, max_seq_len=4096, num_sms=132) == 16
    assert choose_num_splits(num_seqs=2, num_kv_heads=8, max_seq_len=300, num_sms=132) == 1


def test_decode_order_of_puts_the_longest_first() -> None:
    """The triton backend's decode order (DECODE_ORDER_NOTE): a permutation, longest context first."""
    from conveyor.kernels.unified_attention import decode_order_of

    order = decode_order_of(torch.tensor([5, 90, 0, 17, 90], dtype=torch.int32))
    assert sorted(order.tolist()) == [0, 1, 2, 3, 4]
    assert torch.tensor([5, 90, 0, 17, 90])[order].tolist() == [90, 90, 17, 5, 0]
