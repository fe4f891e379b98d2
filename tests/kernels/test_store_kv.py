"""store_kv_ref writes each token's K/V at its slot and skips padding slots; under Triton's interpreter
(TRITON_INTERPRET=1, see test_fp8_kv_interpret.py) the kernel writes the reference's bits."""

from __future__ import annotations

import os

import pytest
import torch

from conveyor.kernels.store_kv import store_kv, store_kv_ref
from conveyor.kernels.triton_compat import HAS_TRITON


def test_reference_writes_slots_and_skips_negative() -> None:
    key_cache = torch.zeros(3, 4, 2, 8)
    value_cache = torch.zeros(3, 4, 2, 8)
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    store_kv_ref(key, value, key_cache, value_cache, torch.tensor([5, -1, 11]))
    assert torch.equal(key_cache[1, 1], key[0]) and torch.equal(value_cache[2, 3], value[2])
    assert int((key_cache != 0).any(-1).any(-1).sum()) == 2  # the padding token wrote nothing


def test_reference_accepts_strided_rows() -> None:
    qkv = torch.randn(2, 3, 2, 8)  # [T, q|k|v, kvh, d]: key is a strided view, as after a fused qkv
    key_cache, value_cache = torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8)
    store_kv_ref(qkv[:, 1], qkv[:, 2], key_cache, value_cache, torch.tensor([0, 3]))
    assert torch.equal(key_cache[0, 3], qkv[1, 1])


@pytest.mark.skipif(HAS_TRITON, reason="checks the CPU-only stand-in")
def test_kernel_without_triton_says_what_to_use() -> None:
    with pytest.raises(RuntimeError, match="torch attention backend"):
        store_kv(torch.randn(1, 2, 8), torch.randn(1, 2, 8), torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8),
                 torch.tensor([0]))


@pytest.mark.skipif(not HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs Triton's interpreter: TRITON_INTERPRET=1 with triton importable")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slots", [[6], [5, -1, 11, 0, -1, 2]])
def test_interpreted_kernel_writes_the_references_bits(dtype: torch.dtype, slots: list[int]) -> None:
    """A copy (no arithmetic for a 16-bit cache), so the bits must be the reference's: strided K/V rows out
    of a fused qkv, 3 kv heads (off a power of two), padding slots skipped."""
    num_tokens = len(slots)
    qkv = torch.randn(num_tokens, 3, 3, 64).to(dtype)  # [T, q|k|v, kvh, d]
    caches = [torch.full((3, 4, 3, 64), 7.0, dtype=dtype) for _ in range(4)]  # 7: what no token writes
    slot_mapping = torch.tensor(slots, dtype=torch.int32)
    store_kv(qkv[:, 1], qkv[:, 2], caches[0], caches[1], slot_mapping)
    store_kv_ref(qkv[:, 1], qkv[:, 2], caches[2], caches[3], slot_mapping)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
