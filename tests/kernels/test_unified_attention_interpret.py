"""The unified attention kernel over 32-bit caches, run on the CPU by Triton's interpreter, against the
float32 reference: prefills of many query blocks beside decodes, so every program's (sequence, block)
mapping is exercised, heaviest block first (HEAVY_FIRST_NOTE) included.

    pip install --target /tmp/triton triton   # a CPU-only checkout has none
    TRITON_INTERPRET=1 PYTHONPATH=src:/tmp/triton python -m pytest -q -p no:cacheprovider \\
        tests/kernels/test_unified_attention_interpret.py

Queries and caches are float32: the interpreter's bf16 `tl.dot` is wrong (test_fp8_kv_interpret.py).
"""

from __future__ import annotations

import os

import pytest
import torch
from kernel_fixtures import Shape, make_case, relative_error

from conveyor.kernels.paged_batch import PagedBatch, paged_attention_ref
from conveyor.kernels.triton_compat import HAS_TRITON
from conveyor.kernels.unified_attention import (
    UnifiedTile,
    decode_order_of,
    unified_attention,
    unified_attention_with_tile,
)

pytestmark = pytest.mark.skipif(not HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs Triton's interpreter: TRITON_INTERPRET=1 with triton importable")

SHAPES = [
    # three prefills of 5, 3 and 1 query blocks (BLOCK_Q 16 at GQA 4) around decodes: two launches
    Shape(8, 2, 64, 16, query_lens=(70, 1, 40, 1, 9), context_lens=(0, 50, 33, 90, 20)),
    # one long chunk after a cached prefix, GQA 1, padded head_dim
    Shape(4, 4, 80, 16, query_lens=(100,), context_lens=(37,)),
    # a chunk whose length is an exact number of blocks, beside a two-token sequence
    Shape(8, 2, 64, 16, query_lens=(64, 2), context_lens=(16, 5)),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"q{'-'.join(map(str, s.query_lens))}d{s.head_dim}")
def test_prefill_blocks_match_the_reference(shape: Shape) -> None:
    case = make_case(shape, dtype=torch.float32, seed=11)
    scale = shape.head_dim**-0.5
    out = unified_attention(case.query, case.key_cache, case.value_cache, case.batch, scale)
    ref = paged_attention_ref(case.query, case.key_cache, case.value_cache, case.batch, scale)
    assert relative_error(out, ref) <= 1e-5


def test_one_launch_with_small_blocks_matches_the_reference() -> None:
    """BLOCK_Q 4: a 70-token prefill is 18 blocks, the last one partial, all in one launch."""
    shape = SHAPES[0]
    case = make_case(shape, dtype=torch.float32, seed=12)
    tile = UnifiedTile(block_q=4, block_m=16, tile_n=32, num_warps=4, num_stages=2)
    scale = shape.head_dim**-0.5
    out = unified_attention_with_tile(case.query, (case.key_cache, case.value_cache), case.batch, scale, tile)
    ref = paged_attention_ref(case.query, case.key_cache, case.value_cache, case.batch, scale)
    assert relative_error(out, ref) <= 1e-5


def test_a_padding_sequence_writes_zeros_and_leaves_the_rest() -> None:
    """A CUDA-graph bucket's padding: a last sequence of seq_len 0 owning 20 query tokens."""
    shape = SHAPES[0]
    case = make_case(shape, dtype=torch.float32, seed=13)
    real = case.query.shape[0]
    query = torch.cat([case.query, torch.randn(20, *case.query.shape[1:])])
    batch = PagedBatch(
        block_tables=torch.cat([case.batch.block_tables, case.batch.block_tables[:1]]),
        seq_lens=torch.cat([case.batch.seq_lens, torch.zeros(1, dtype=torch.int32)]),
        query_start_loc=torch.cat([case.batch.query_start_loc, torch.tensor([real + 20], dtype=torch.int32)]),
        max_query_len=case.batch.max_query_len, max_seq_len=case.batch.max_seq_len,
    )
    scale = shape.head_dim**-0.5
    out = unified_attention(query, case.key_cache, case.value_cache, batch, scale)
    ref = paged_attention_ref(case.query, case.key_cache, case.value_cache, case.batch, scale)
    assert relative_error(out[:real], ref) <= 1e-5
    assert torch.equal(out[real:], torch.zeros_like(out[real:]))


ORDERED = [
    Shape(8, 2, 64, 16, query_lens=(1, 1, 1, 1, 1), context_lens=(40, 300, 7, 130, 0)),  # decode-only
    Shape(8, 2, 64, 16, query_lens=(1, 70, 1, 1, 9), context_lens=(90, 0, 33, 200, 20)),  # mixed
]


@pytest.mark.parametrize("shape", ORDERED, ids=["decode", "mixed"])
@pytest.mark.parametrize("order", ["longest first", "reversed", "identity"])
def test_an_ordered_decode_launch_matches_the_reference(shape: Shape, order: str) -> None:
    """DECODE_ORDER_NOTE: any permutation of the sequences gives every decode its own output."""
    case = make_case(shape, dtype=torch.float32, seed=14)
    num_seqs = len(shape.query_lens)
    permutation = {"longest first": decode_order_of(case.batch.seq_lens),
                   "reversed": torch.arange(num_seqs - 1, -1, -1), "identity": torch.arange(num_seqs)}[order]
    scale = shape.head_dim**-0.5
    out = unified_attention(case.query, case.key_cache, case.value_cache, case.batch, scale,
                            decode_order=permutation)
    ref = paged_attention_ref(case.query, case.key_cache, case.value_cache, case.batch, scale)
    assert relative_error(out, ref) <= 1e-5
