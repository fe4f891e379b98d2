"""KV cache sizing arithmetic and allocation."""

from __future__ import annotations

import pytest
import torch

from conveyor.config import CacheConfig
from conveyor.worker.kv_cache import (
    DEFAULT_CPU_KV_CACHE_MEMORY_BYTES,
    GpuMemoryProfile,
    KVCacheSizingError,
    KVCacheSpec,
    KVCapacity,
    allocate_kv_caches,
    check_fits_max_model_len,
    num_blocks_for_gpu,
    num_blocks_from_memory,
    profile_gpu_memory,
    resolve_num_blocks,
)

# SmolLM2-135M: 30 layers, 3 KV heads of 64 channels; float32 on CPU.
SMOLLM2 = KVCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype_bytes=4)
CPU = torch.device("cpu")


def test_bytes_per_token_and_block() -> None:
    assert SMOLLM2.bytes_per_token == 2 * 30 * 3 * 64 * 4 == 46080
    assert SMOLLM2.bytes_per_block == 46080 * 16


def test_num_blocks_from_memory_floors() -> None:
    assert num_blocks_from_memory(SMOLLM2, 10 * SMOLLM2.bytes_per_block + 1) == 10
    assert num_blocks_from_memory(SMOLLM2, 1 << 30) == (1 << 30) // 737280 == 1456
    with pytest.raises(KVCacheSizingError, match="kv-cache-memory"):
        num_blocks_from_memory(SMOLLM2, SMOLLM2.bytes_per_block - 1)


def test_num_blocks_for_gpu_subtracts_peak_and_non_torch() -> None:
    spec = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype_bytes=2)
    gib = 1 << 30
    profile = GpuMemoryProfile(total_bytes=80 * gib, peak_torch_bytes=17 * gib, non_torch_bytes=gib)
    expected = (int(80 * gib * 0.9) - 18 * gib) // spec.bytes_per_block
    assert num_blocks_for_gpu(spec, 0.9, profile) == expected == 27648  # 54 GiB / 2 MiB
    with pytest.raises(KVCacheSizingError, match="gpu-memory-utilization"):
        num_blocks_for_gpu(spec, 0.2, profile)


def test_resolve_precedence() -> None:
    assert resolve_num_blocks(SMOLLM2, CacheConfig(num_blocks_override=7,
                                                    kv_cache_memory_bytes=1 << 30), CPU) == 7
    memory = CacheConfig(kv_cache_memory_bytes=3 * SMOLLM2.bytes_per_block)
    assert resolve_num_blocks(SMOLLM2, memory, CPU) == 3
    default = resolve_num_blocks(SMOLLM2, CacheConfig(), CPU)
    assert default == DEFAULT_CPU_KV_CACHE_MEMORY_BYTES // SMOLLM2.bytes_per_block


def test_resolve_on_cuda_uses_the_profile_only_without_a_budget() -> None:
    cuda = torch.device("cuda")
    calls: list[int] = []

    def profile() -> GpuMemoryProfile:
        calls.append(1)
        return GpuMemoryProfile(total_bytes=1 << 34, peak_torch_bytes=1 << 30, non_torch_bytes=0)

    assert resolve_num_blocks(SMOLLM2, CacheConfig(kv_cache_memory_bytes=1 << 30), cuda, profile) == 1456
    assert not calls
    blocks = resolve_num_blocks(SMOLLM2, CacheConfig(gpu_memory_utilization=0.5), cuda, profile)
    assert blocks == ((1 << 33) - (1 << 30)) // SMOLLM2.bytes_per_block and calls == [1]


def test_capacity_concurrency_and_description() -> None:
    capacity = KVCapacity(num_blocks=100, block_size=16, num_bytes=100 * 737280, max_model_len=400)
    assert capacity.num_tokens == 1600
    assert capacity.max_concurrency == 100 / 25
    assert "1600 tokens" in capacity.describe() and "4.00x" in capacity.describe()
    check_fits_max_model_len(capacity)
    with pytest.raises(KVCacheSizingError, match="max-model-len"):
        check_fits_max_model_len(KVCapacity(10, 16, 0, max_model_len=161))


def test_allocate_shapes_and_dtype() -> None:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype_bytes=2)
    caches = allocate_kv_caches(spec, 5, CPU, torch.bfloat16)
    assert len(caches) == 2
    assert all(c.shape == (2, 5, 4, 2, 8) and c.dtype == torch.bfloat16 for c in caches)
    assert caches[0].data_ptr() != caches[1].data_ptr()
    assert sum(c.numel() * c.element_size() for c in caches) == 5 * spec.bytes_per_block
    with pytest.raises(ValueError, match="dtype_bytes"):
        allocate_kv_caches(spec, 5, CPU, torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_profile_gpu_memory_measures_a_peak() -> None:
    device = torch.device("cuda")

    def forward() -> int:
        scratch = torch.empty(64 << 20, dtype=torch.uint8, device=device)
        torch.empty(256 << 20, dtype=torch.uint8, device=device)
        return scratch.numel()

    profile = profile_gpu_memory(device, forward)
    assert profile.peak_torch_bytes >= 256 << 20  # the scratch is left out, the activation is not
    assert profile.total_bytes > profile.peak_torch_bytes
