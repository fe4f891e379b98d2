"""The FP8 KV cache's torch side (CPU): quantize / dequantize round trips within the format's unit
roundoff, saturation instead of NaN, the store reference writing what `quantize_kv` gives, and paged
attention over an FP8 cache staying within a stated bound of full precision. These references are the
oracle of the GPU tests in test_fp8_kv_gpu.py."""

from __future__ import annotations

import pytest
import torch
from kernel_fixtures import Shape, make_case, relative_error

from conveyor.kernels.fp8_kv import (
    FP8_KV_DTYPES,
    KVScales,
    dequantize_kv,
    is_fp8,
    quantize_kv,
)
from conveyor.kernels.paged_batch import paged_attention_ref
from conveyor.kernels.split_kv_attention import SplitKVParams, split_kv_attention_ref
from conveyor.kernels.store_kv import store_kv_ref

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
UNIT_ROUNDOFF = {E4M3: 2.0**-4, E5M2: 2.0**-3}
"""Half a unit in the last place, relative: 3 mantissa bits (e4m3), 2 (e5m2)."""
ATTENTION_BOUND = {E4M3: 2.0**-4, E5M2: 2.0**-3}
"""Bound on ||out_fp8 - out_bf16|| / ||out_bf16|| of attention over unit-variance K/V (measured: about
0.03 for e4m3 and 0.06-0.08 for e5m2 on these shapes): the per-element roundoff, which the softmax
average over many keys shrinks rather than grows."""
SCALES = [KVScales(), KVScales(k_scale=0.05, v_scale=0.02)]


def test_spellings_map_to_vllms_dtypes() -> None:
    assert FP8_KV_DTYPES == {"fp8": E4M3, "fp8_e4m3": E4M3, "fp8_e5m2": E5M2}
    assert is_fp8(E4M3) and is_fp8(E5M2) and not is_fp8(torch.bfloat16)
    with pytest.raises(ValueError, match="> 0"):
        KVScales(k_scale=0.0)


@pytest.mark.parametrize("scale", [1.0, 0.05, 4.0])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_round_trip_error_within_unit_roundoff(dtype: torch.dtype, scale: float) -> None:
    x = (torch.randn(50_000, generator=torch.Generator().manual_seed(1)) * 3 * scale).to(torch.bfloat16)
    stored = quantize_kv(x, dtype, scale)
    assert stored.dtype == dtype
    back = dequantize_kv(stored, torch.float32, scale)  # [N]
    exact = x.float()
    normal = (exact / scale).abs() >= torch.finfo(dtype).smallest_normal
    relative = (back - exact).abs()[normal] / exact.abs()[normal]
    assert relative.max() <= UNIT_ROUNDOFF[dtype]
    # Below the smallest normal the spacing is fixed: half of it is the error bound.
    subnormal_step = torch.finfo(dtype).smallest_normal * 2 * UNIT_ROUNDOFF[dtype]
    assert ((back - exact).abs()[~normal] <= scale * subnormal_step / 2 * (1 + 1e-5)).all()  # float32 x / s


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_saturates_to_the_formats_max_never_nan(dtype: torch.dtype) -> None:
    limit = torch.finfo(dtype).max
    x = torch.tensor([2 * limit, -2 * limit, 1e30, 1.0])
    back = dequantize_kv(quantize_kv(x, dtype, 1.0), torch.float32, 1.0)
    assert back.tolist() == [limit, -limit, limit, 1.0]


def test_non_fp8_is_a_plain_cast() -> None:
    x = torch.randn(5, 3)
    assert torch.equal(quantize_kv(x, torch.bfloat16, 7.0), x.to(torch.bfloat16))
    assert torch.equal(dequantize_kv(x.to(torch.bfloat16), torch.float32, 7.0), x.to(torch.bfloat16).float())


@pytest.mark.parametrize("scales", SCALES)
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_store_reference_writes_quantized_values(dtype: torch.dtype, scales: KVScales) -> None:
    key_cache = torch.zeros(3, 4, 2, 8, dtype=dtype)  # [nb, bs, kvh, d]
    value_cache = torch.zeros(3, 4, 2, 8, dtype=dtype)
    key, value = torch.randn(3, 2, 8).to(torch.bfloat16), torch.randn(3, 2, 8).to(torch.bfloat16)
    store_kv_ref(key, value, key_cache, value_cache, torch.tensor([5, -1, 11]), scales=scales)
    expected_k = quantize_kv(key, dtype, scales.k_scale)
    expected_v = quantize_kv(value, dtype, scales.v_scale)
    assert torch.equal(key_cache[1, 1].view(torch.uint8), expected_k[0].view(torch.uint8))
    assert torch.equal(value_cache[2, 3].view(torch.uint8), expected_v[2].view(torch.uint8))
    assert int((key_cache.float() != 0).any(-1).any(-1).sum()) == 2  # the padding token wrote nothing


SHAPES = [
    Shape(8, 2, 64, 16, query_lens=(1, 1, 37, 1), context_lens=(40, 300, 0, 1000)),  # mixed, GQA 4
    Shape(16, 4, 128, 16, query_lens=(1,) * 4, context_lens=(100, 500, 2000, 4000)),  # decodes
    Shape(4, 4, 80, 32, query_lens=(70, 5), context_lens=(30, 0)),  # prefills, padded head_dim
]


def fp8_caches(key_cache: torch.Tensor, value_cache: torch.Tensor, dtype: torch.dtype,
               scales: KVScales) -> tuple[torch.Tensor, torch.Tensor]:
    """The same paged K/V stored at `dtype` with `scales` (as store_kv would have written them)."""
    return quantize_kv(key_cache, dtype, scales.k_scale), quantize_kv(value_cache, dtype, scales.v_scale)


@pytest.mark.parametrize("scales", SCALES)
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s.num_heads}kv{s.num_kv_heads}d{s.head_dim}")
def test_attention_over_fp8_kv_is_close_to_bf16(shape: Shape, dtype: torch.dtype, scales: KVScales) -> None:
    case = make_case(shape, dtype=torch.bfloat16, seed=3)
    scale = shape.head_dim**-0.5
    full = paged_attention_ref(case.query, case.key_cache, case.value_cache, case.batch, scale)
    key_cache, value_cache = fp8_caches(case.key_cache, case.value_cache, dtype, scales)
    out = paged_attention_ref(case.query, key_cache, value_cache, case.batch, scale, kv_scales=scales)
    assert not out.isnan().any()
    assert 0 < relative_error(out, full) <= ATTENTION_BOUND[dtype]


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_split_kv_reference_reads_fp8_like_the_paged_reference(num_splits: int) -> None:
    shape = SHAPES[1]
    case = make_case(shape, dtype=torch.bfloat16, seed=num_splits)
    scales = SCALES[1]
    key_cache, value_cache = fp8_caches(case.key_cache, case.value_cache, E4M3, scales)
    params = SplitKVParams(scale=shape.head_dim**-0.5, num_splits=num_splits, kv_scales=scales)
    split = split_kv_attention_ref(case.query, key_cache, value_cache, case.batch, params)
    paged = paged_attention_ref(case.query, key_cache, value_cache, case.batch, params.scale, kv_scales=scales)
    assert relative_error(split, paged) <= 1e-5


def test_reference_refuses_a_cache_of_another_16_bit_dtype() -> None:
    case = make_case(SHAPES[0], dtype=torch.bfloat16)
    with pytest.raises(AssertionError, match="query's dtype or FP8"):
        paged_attention_ref(case.query, case.key_cache.half(), case.value_cache.half(), case.batch, 0.1)
