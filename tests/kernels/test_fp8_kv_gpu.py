"""The Triton kernels over an FP8 KV cache against the torch references of fp8_kv.py (CUDA only).

Run on a GPU: `python -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_kv_gpu.py`. The store
kernel must write the reference's bits (its scales divide exactly: powers of two); the attention
kernels must match the float32 reference over the same FP8 cache as closely as the bf16 kernels match
theirs, and stay within the format's bound of attention over the bf16 cache.
"""

from __future__ import annotations

import pytest
import torch
from kernel_fixtures import Shape, make_case, relative_error
from test_attention_kernels_gpu import HEADS, TOLERANCE, _id, _shapes
from test_fp8_kv import ATTENTION_BOUND, fp8_caches

from conveyor.kernels.fp8_kv import KVScales, dequantize_kv
from conveyor.kernels.paged_batch import paged_attention_ref
from conveyor.kernels.split_kv_attention import (
    SplitKVParams,
    split_kv_attention,
    split_kv_attention_ref,
)
from conveyor.kernels.store_kv import store_kv, store_kv_ref
from conveyor.kernels.triton_compat import HAS_TRITON
from conveyor.kernels.unified_attention import unified_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and Triton"),
]
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EXACT_SCALES = [KVScales(), KVScales(k_scale=0.5, v_scale=2.0)]


@pytest.mark.parametrize("scales", EXACT_SCALES)
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_store_kv_writes_the_references_bits(dtype: torch.dtype, scales: KVScales) -> None:
    gen = torch.Generator().manual_seed(0)
    key = (torch.randn(40, 8, 128, generator=gen) * 200).to(torch.bfloat16).cuda()  # some past e4m3's 448
    value = torch.randn(40, 8, 128, generator=gen).to(torch.bfloat16).cuda()
    slots = torch.randperm(64 * 16, generator=gen)[:40].cuda()
    slots[3] = -1  # a CUDA-graph padding token
    caches = [torch.zeros(64, 16, 8, 128, dtype=dtype, device="cuda") for _ in range(4)]
    store_kv(key, value, caches[0], caches[1], slots, scales=scales)
    store_kv_ref(key, value, caches[2], caches[3], slots, scales=scales)
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))
    assert not dequantize_kv(caches[0], torch.float32, scales.k_scale).isnan().any()


def test_store_kv_with_an_inexact_scale_is_within_one_step() -> None:
    key = torch.randn(16, 4, 64, device="cuda", dtype=torch.bfloat16)
    caches = [torch.zeros(4, 16, 4, 64, dtype=E4M3, device="cuda") for _ in range(4)]
    slots = torch.arange(16, device="cuda")
    scales = KVScales(k_scale=0.05, v_scale=0.07)
    store_kv(key, key, caches[0], caches[1], slots, scales=scales)
    store_kv_ref(key, key, caches[2], caches[3], slots, scales=scales)
    kernel, ref = (dequantize_kv(c, torch.float32, 0.05) for c in (caches[0], caches[2]))
    torch.testing.assert_close(kernel, ref, rtol=2.0**-3, atol=0.05 * 2.0**-9)


@pytest.mark.parametrize("scales", [KVScales(), KVScales(k_scale=0.05, v_scale=0.02)])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("shape", _shapes()[::3] + _shapes()[-4:], ids=_id)
def test_unified_attention_over_fp8_matches_reference(shape: Shape, dtype: torch.dtype, scales: KVScales) -> None:
    case = make_case(shape, dtype=torch.bfloat16, device="cuda", seed=hash(shape) % 1000)
    scale = shape.head_dim**-0.5
    key_cache, value_cache = fp8_caches(case.key_cache, case.value_cache, dtype, scales)
    out = unified_attention(case.query, key_cache, value_cache, case.batch, scale, kv_scales=scales)
    ref = paged_attention_ref(case.query, key_cache, value_cache, case.batch, scale, kv_scales=scales)
    assert not out.isnan().any()
    assert relative_error(out, ref) <= TOLERANCE
    full = paged_attention_ref(case.query, case.key_cache, case.value_cache, case.batch, scale)
    assert relative_error(out, full) <= ATTENTION_BOUND[dtype]


@pytest.mark.parametrize("num_splits", [1, 3, 8, 32])
@pytest.mark.parametrize("heads", HEADS)
def test_split_kv_over_fp8_matches_reference(heads: tuple[int, int], num_splits: int) -> None:
    shape = Shape(heads[0], heads[1], 128, 16, query_lens=(1,) * 4, context_lens=(0, 15, 700, 5000))
    case = make_case(shape, dtype=torch.bfloat16, device="cuda", seed=num_splits)
    scales = KVScales(k_scale=0.05, v_scale=0.02)
    key_cache, value_cache = fp8_caches(case.key_cache, case.value_cache, E4M3, scales)
    params = SplitKVParams(scale=128**-0.5, num_splits=num_splits, kv_scales=scales)
    out = split_kv_attention(case.query, key_cache, value_cache, case.batch, params)
    ref = split_kv_attention_ref(case.query, key_cache, value_cache, case.batch, params)
    assert relative_error(out, ref) <= TOLERANCE


def test_triton_backend_equals_torch_backend_on_an_fp8_cache() -> None:
    """Both backends behind the AttentionBackend protocol: same cache bits, same outputs."""
    from conveyor.model.attention import TorchAttentionBackend, kv_cache_shape
    from conveyor.model.attention_metadata import SequenceSpec, build_attention_metadata
    from conveyor.model.attention_triton import TritonAttentionBackend

    specs = [SequenceSpec(1, 300, list(range(19))), SequenceSpec(40, 70, list(range(19, 24)))]
    metadata = build_attention_metadata(specs, 16, "cuda")
    scales = KVScales(k_scale=0.5, v_scale=0.25)
    caches = [torch.zeros(kv_cache_shape(24, 16, 2, 64), dtype=E4M3, device="cuda") for _ in range(2)]
    key = torch.randn(metadata.num_tokens, 2, 64, device="cuda", dtype=torch.bfloat16)
    query = torch.randn(metadata.num_tokens, 8, 64, device="cuda", dtype=torch.bfloat16)
    outs = []
    for backend, cache in zip((TritonAttentionBackend(), TorchAttentionBackend()), caches):
        backend.write_kv(key, -key, cache, metadata.slot_mapping, scales)
        metadata.backend_plan = None
        outs.append(backend.forward(query, cache, metadata, 0.125, scales))
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))
    assert relative_error(outs[0], outs[1]) <= TOLERANCE
