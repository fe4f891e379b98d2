"""store_kv_ref writes each token's K/V at its slot and skips padding slots."""

from __future__ import annotations

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
