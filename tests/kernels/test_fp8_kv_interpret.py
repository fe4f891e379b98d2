"""The FP8 paths of the Triton kernels run on the CPU by Triton's interpreter, against the torch references.

Not a GPU proof (test_fp8_kv_gpu.py is), but it checks the kernels' FP8 logic -- the KV_FP8 variants,
the scales, masked and unmasked tiles, both launches of a mixed batch, split-KV -- without a device:

    pip install --target /tmp/triton triton   # a CPU-only checkout has none
    TRITON_INTERPRET=1 PYTHONPATH=src:/tmp/triton python -m pytest -q -p no:cacheprovider \\
        tests/kernels/test_fp8_kv_interpret.py

Two limits of the interpreter (Triton 3.9) shape the cases: its bf16 `tl.dot` is wrong for the unchanged
16-bit kernels too, so queries are float32 (the FP8 tiles are dequantized to float32); and its
float-to-fp8 cast neither rounds ties to even nor carries into the exponent (124.5 -> 64 in e4m3), so
the store kernel gets values the format holds exactly (any rounding gives the same bits).
"""

from __future__ import annotations

import os

import pytest
import torch
from kernel_fixtures import Shape, make_case, relative_error
from test_fp8_kv import fp8_caches

from conveyor.kernels.fp8_kv import KVScales, quantize_kv
from conveyor.kernels.paged_batch import paged_attention_ref
from conveyor.kernels.split_kv_attention import (
    SplitKVParams,
    split_kv_attention,
    split_kv_attention_ref,
)
from conveyor.kernels.store_kv import store_kv, store_kv_ref
from conveyor.kernels.triton_compat import HAS_TRITON
from conveyor.kernels.unified_attention import unified_attention

pytestmark = pytest.mark.skipif(not HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs Triton's interpreter: TRITON_INTERPRET=1 with triton importable")
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
SCALES = KVScales(k_scale=0.05, v_scale=0.02)


@pytest.mark.parametrize("dtype", FP8)
def test_store_kv_writes_the_references_bits(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    scales = KVScales(k_scale=0.5, v_scale=2.0)  # powers of two: x / scale is exact
    grid = quantize_kv(torch.randn(10, 4, 64, generator=gen) * 100, dtype, 1.0).float()  # values fp8 holds
    key = (grid * scales.k_scale).to(torch.bfloat16)
    key[0, 0, :4] = torch.tensor([1e6, -1e6, 0.0, -0.0])  # saturate to +-max; signed zeros kept
    value = (grid * scales.v_scale).to(torch.bfloat16)
    slots = torch.randperm(8 * 16, generator=gen)[:10]
    slots[3] = -1  # a CUDA-graph padding token writes nothing
    caches = [torch.zeros(8, 16, 4, 64, dtype=dtype) for _ in range(4)]
    store_kv(key, value, caches[0], caches[1], slots, scales=scales)
    store_kv_ref(key, value, caches[2], caches[3], slots, scales=scales)
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))


SHAPES = [
    Shape(8, 2, 64, 16, query_lens=(1, 1, 19, 1), context_lens=(40, 70, 0, 100)),  # mixed: two launches
    Shape(4, 4, 80, 16, query_lens=(1, 70, 1), context_lens=(130, 10, 0)),  # padded head_dim, masked tiles
    Shape(8, 2, 64, 16, query_lens=(1, 1, 1), context_lens=(40, 300, 130)),  # decode-only: one launch
]


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"q{len(s.query_lens)}d{s.head_dim}")
def test_unified_attention_over_fp8(shape: Shape, dtype: torch.dtype) -> None:
    case = make_case(shape, dtype=torch.float32, seed=3)
    key_cache, value_cache = fp8_caches(case.key_cache, case.value_cache, dtype, SCALES)
    scale = shape.head_dim**-0.5
    out = unified_attention(case.query, key_cache, value_cache, case.batch, scale, kv_scales=SCALES)
    ref = paged_attention_ref(case.query, key_cache, value_cache, case.batch, scale, kv_scales=SCALES)
    assert relative_error(out, ref) <= 1e-5


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", FP8)
def test_split_kv_over_fp8(dtype: torch.dtype, num_splits: int) -> None:
    case = make_case(SHAPES[2], dtype=torch.float32, seed=4)
    key_cache, value_cache = fp8_caches(case.key_cache, case.value_cache, dtype, SCALES)
    params = SplitKVParams(scale=0.125, num_splits=num_splits, kv_scales=SCALES)
    out = split_kv_attention(case.query, key_cache, value_cache, case.batch, params)
    ref = split_kv_attention_ref(case.query, key_cache, value_cache, case.batch, params)
    assert relative_error(out, ref) <= 1e-5


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"q{len(s.query_lens)}d{s.head_dim}")
def test_a_bf16_query_over_fp8_takes_fp16_dots(shape: Shape, dtype: torch.dtype) -> None:
    """A bf16 query over an FP8 cache runs both dots in fp16 (FP8_DOT_NOTE): within bf16's output rounding
    of the float32 reference. (The interpreter's bf16 dot is wrong, so a bf16 dot would fail here.)"""
    case = make_case(shape, dtype=torch.float32, seed=5)
    key_cache, value_cache = fp8_caches(case.key_cache, case.value_cache, dtype, SCALES)
    query = case.query.to(torch.bfloat16)
    out = unified_attention(query, key_cache, value_cache, case.batch, shape.head_dim**-0.5, kv_scales=SCALES)
    ref = paged_attention_ref(query.float(), key_cache, value_cache, case.batch, shape.head_dim**-0.5,
                              kv_scales=SCALES)
    assert out.dtype == torch.bfloat16 and relative_error(out.float(), ref) <= 8e-3


@pytest.mark.parametrize("dtype", FP8)
def test_split_kv_with_a_bf16_query_takes_fp16_dots(dtype: torch.dtype) -> None:
    case = make_case(SHAPES[2], dtype=torch.float32, seed=6)
    key_cache, value_cache = fp8_caches(case.key_cache, case.value_cache, dtype, SCALES)
    params = SplitKVParams(scale=0.125, num_splits=3, kv_scales=SCALES)
    query = case.query.to(torch.bfloat16)
    out = split_kv_attention(query, key_cache, value_cache, case.batch, params)
    ref = split_kv_attention_ref(query.float(), key_cache, value_cache, case.batch, params)
    assert out.dtype == torch.bfloat16 and relative_error(out.float(), ref) <= 8e-3
