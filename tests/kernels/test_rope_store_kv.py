"""The rope kernels' K/V store (rotary.py, qk_norm_rope.py with value, caches and slot_mapping) against the
launches it replaces: the same kernel without the store, then `store_kv` of its k.

Under Triton's interpreter (TRITON_INTERPRET=1 with triton importable, see test_qk_norm_rope.py): the cache
bytes must be exactly store_kv's (bf16 and FP8 e4m3 caches; the FP8 store is store_kv.py's `store_kv_rows`,
so even the interpreter's own fp8 rounding is the same in both), a padding slot (-1) writes nothing, and q/k
are the kernel's bits without the store. The caches start as random bytes, so an untouched row is checked.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch
from test_qk_norm_rope import EPS, QKV

from conveyor.kernels.fp8_kv import UNIT_KV_SCALES, KVScales
from conveyor.kernels.qk_norm_rope import qk_norm_rope_, qk_norm_rope_store_kv_ref
from conveyor.kernels.rotary import rotary_, rotary_store_kv_ref
from conveyor.kernels.store_kv import store_kv
from conveyor.kernels.triton_compat import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs Triton's interpreter: TRITON_INTERPRET=1 with triton importable")
NUM_BLOCKS, BLOCK_SIZE = 4, 8
CACHES = [(torch.bfloat16, UNIT_KV_SCALES), (torch.float8_e4m3fn, KVScales(k_scale=0.5, v_scale=2.0))]
Rope = Callable[..., None]


def _qwen3_rope(case: QKV, **store: object) -> None:
    qk_norm_rope_(case.q, case.k, case.q_weight, case.k_weight, case.cos, case.sin, EPS, **store)  # type: ignore[arg-type]


def _llama_rope(case: QKV, **store: object) -> None:
    rotary_(case.q, case.k, case.cos, case.sin, **store)  # type: ignore[arg-type]


def _random_caches(kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches [NUM_BLOCKS, BLOCK_SIZE, kvh, d] of random bytes (finite values for 16-bit dtypes)."""
    generator = torch.Generator().manual_seed(7)
    shape = (NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim)
    if dtype.itemsize == 1:
        raw = torch.randint(0, 127, (2, *shape), dtype=torch.uint8, generator=generator)  # no NaN codes
        return raw[0].view(dtype), raw[1].view(dtype)
    values = torch.randn(2, *shape, generator=generator).to(dtype)
    return values[0], values[1]


def _slots(num_tokens: int) -> torch.Tensor:
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=torch.Generator().manual_seed(3))[:num_tokens]
    slots[1] = -1  # a CUDA-graph padding token: nothing written
    return slots


@pytest.mark.parametrize("rope", [_qwen3_rope, _llama_rope], ids=["qk_norm_rope", "rotary"])
@pytest.mark.parametrize(("cache_dtype", "scales"), CACHES, ids=["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("shape", [(4, 2, 64), (6, 3, 32)])
def test_the_fused_store_writes_store_kvs_bytes(rope: Rope, cache_dtype: torch.dtype, scales: KVScales,
                                                shape: tuple[int, int, int]) -> None:
    num_tokens, (_, kv_heads, head_dim) = 5, shape
    slots = _slots(num_tokens)
    fused, unfused = QKV(num_tokens, shape, torch.bfloat16), QKV(num_tokens, shape, torch.bfloat16)
    fused_caches = _random_caches(kv_heads, head_dim, cache_dtype)
    before = [cache.clone() for cache in fused_caches]
    unfused_caches = (fused_caches[0].clone(), fused_caches[1].clone())
    value = fused.v.view(num_tokens, kv_heads, head_dim)  # a strided view of the qkv rows, as the model passes
    rope(fused, value=value, key_cache=fused_caches[0], value_cache=fused_caches[1], slot_mapping=slots,
         kv_scales=scales)
    rope(unfused)
    store_kv(unfused.k, unfused.v.view(num_tokens, kv_heads, head_dim), *unfused_caches, slots, scales=scales)
    assert torch.equal(fused.qkv, unfused.qkv)  # q and k rotated in place as before, v untouched
    for got, want, old in zip(fused_caches, unfused_caches, before):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        written = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
        written[slots[slots >= 0]] = True
        unwritten = ~written.view(NUM_BLOCKS, BLOCK_SIZE)
        assert torch.equal(got.view(torch.uint8)[unwritten], old.view(torch.uint8)[unwritten])
        assert not torch.equal(got.view(torch.uint8)[~unwritten], old.view(torch.uint8)[~unwritten])


def test_the_references_store_the_rotated_key() -> None:
    """The torch references: qk_norm_rope's and rotary's (q, k), with that k and v in the caches at the slots."""
    case, slots = QKV(3, (4, 2, 64), torch.float32), torch.tensor([5, -1, 9])
    value = case.v.view(3, 2, 64)
    qwen3_caches, llama_caches = _random_caches(2, 64, torch.float32), _random_caches(2, 64, torch.float32)
    results = [
        (*qk_norm_rope_store_kv_ref(case.q, case.k, (case.q_weight, case.k_weight), (case.cos, case.sin), EPS,
                                    value, qwen3_caches, slots), qwen3_caches),
        (*rotary_store_kv_ref(case.q, case.k, case.cos, case.sin, value, *llama_caches, slots), llama_caches),
    ]
    for _, k, (key_cache, value_cache) in results:
        assert torch.equal(key_cache.view(-1, 2, 64)[[5, 9]], k[[0, 2]])
        assert torch.equal(value_cache.view(-1, 2, 64)[[5, 9]], value[[0, 2]])
