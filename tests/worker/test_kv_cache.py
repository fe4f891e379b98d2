"""KV cache sizing arithmetic and allocation."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import pytest
import torch

from conveyor.config import CacheConfig
from conveyor.worker.gpu_memory import (
    GpuMemoryProfile,
    MemorySnapshot,
    ProfileStagePeaks,
    profile_from_peaks,
    profile_gpu_memory,
    take_memory_snapshot,
)
from conveyor.worker.kv_cache import (
    DEFAULT_CPU_KV_CACHE_MEMORY_BYTES,
    KVCacheSizingError,
    KVCacheSpec,
    KVCapacity,
    allocate_kv_caches,
    check_fits_max_model_len,
    describe_gpu_memory,
    num_blocks_for_gpu,
    num_blocks_from_memory,
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


def test_num_blocks_for_gpu_subtracts_peak_and_non_torch_increase() -> None:
    spec = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype_bytes=2)
    gib = 1 << 30
    profile = GpuMemoryProfile(total_bytes=80 * gib, peak_torch_bytes=17 * gib, non_torch_bytes=gib,
                               init_non_torch_bytes=0, weights_bytes=15 * gib)
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
        return GpuMemoryProfile(total_bytes=1 << 34, peak_torch_bytes=1 << 30, non_torch_bytes=0,
                                init_non_torch_bytes=0, weights_bytes=1 << 29)

    assert resolve_num_blocks(SMOLLM2, CacheConfig(kv_cache_memory_bytes=1 << 30), cuda, profile) == 1456
    assert not calls
    blocks = resolve_num_blocks(SMOLLM2, CacheConfig(gpu_memory_utilization=0.5), cuda, profile)
    assert blocks == ((1 << 33) - (1 << 30)) // SMOLLM2.bytes_per_block and calls == [1]


# The Llama-3.1-8B shape in bf16: a block of 16 tokens is 2 MiB over the 32 layers.
LLAMA_8B = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype_bytes=2)
GIB, MIB = 1 << 30, 1 << 20


H100_TOTAL = 85_520_809_984  # NVML's total of the pair's H100


def snapshot(non_torch_bytes: int, torch_reserved_bytes: int = 0, total_bytes: int = H100_TOTAL) -> MemorySnapshot:
    """A reading whose memory outside torch is `non_torch_bytes` (free is what the rest leaves)."""
    free_bytes = total_bytes - non_torch_bytes - torch_reserved_bytes
    return MemorySnapshot(free_bytes, total_bytes, torch_reserved_bytes, torch_reserved_bytes)


def fake_llama_profile() -> GpuMemoryProfile:
    """A profile as profile_gpu_memory reads it on an H100: 15 GiB of weights, the four peaks of the pass
    with 1 GiB of scratch KV alive in each; 512 MiB outside torch at the init snapshot (the CUDA context),
    576 MiB after the pass (64 MiB of kernel modules and library workspaces loaded by it)."""
    weights, scratch = 15 * GIB, GIB
    peaks = [weights + scratch + 900 * MIB, weights + scratch + 320 * MIB, weights + scratch + 1550 * MIB,
             weights + scratch]
    after = snapshot(576 * MIB, torch_reserved_bytes=weights + 2 * MIB)
    return profile_from_peaks(after, snapshot(512 * MIB), weights, peaks, scratch)


def test_profile_from_peaks_takes_the_scratch_off_every_stage() -> None:
    profile = fake_llama_profile()
    assert profile.stages == ProfileStagePeaks(15 * GIB + 900 * MIB, 15 * GIB + 320 * MIB, 15 * GIB + 1550 * MIB)
    assert profile.peak_torch_bytes == 15 * GIB + 1550 * MIB  # the largest stage: one reading at the end
    assert profile.activation_peak_bytes == 1550 * MIB
    assert (profile.non_torch_bytes, profile.init_non_torch_bytes) == (576 * MIB, 512 * MIB)
    budget = int(H100_TOTAL * 0.9)
    assert profile.budget_bytes(0.9) == budget
    assert profile.kv_cache_bytes(0.9) == budget - (15 * GIB + 1550 * MIB) - 64 * MIB
    assert num_blocks_for_gpu(LLAMA_8B, 0.9, profile) == profile.kv_cache_bytes(0.9) // (2 * MIB) == 28214
    unmarked = profile_from_peaks(snapshot(0, total_bytes=80 * GIB), snapshot(0, total_bytes=80 * GIB), 15 * GIB,
                                  [17 * GIB], GIB)  # a pass that marked no stage
    assert unmarked.stages is None and unmarked.peak_torch_bytes == 16 * GIB


def test_the_context_at_the_snapshot_is_no_longer_subtracted() -> None:
    """vLLM's rule: only what the engine added outside torch since its init snapshot is charged. The 512 MiB
    present at the snapshot (the context) lives in the margin: 256 blocks of 2 MiB more than charging it,
    which is what profile_gpu_memory did before (memory outside torch read whole, before the pass)."""
    counted = fake_llama_profile()
    charged_whole = dataclasses.replace(counted, init_non_torch_bytes=0)
    assert counted.non_torch_increase_bytes == 64 * MIB and charged_whole.non_torch_increase_bytes == 576 * MIB
    assert num_blocks_for_gpu(LLAMA_8B, 0.9, counted) - num_blocks_for_gpu(LLAMA_8B, 0.9, charged_whole) == 256
    # Memory another process released after the snapshot does not lend the cache bytes: the increase is >= 0.
    released = dataclasses.replace(counted, non_torch_bytes=256 * MIB)
    assert released.non_torch_increase_bytes == 0
    assert released.kv_cache_bytes(0.9) == int(H100_TOTAL * 0.9) - counted.peak_torch_bytes


def test_snapshot_non_torch_is_what_torch_does_not_hold() -> None:
    reading = MemorySnapshot(free_bytes=60 * GIB, total_bytes=80 * GIB, torch_reserved_bytes=19 * GIB,
                             torch_allocated_bytes=18 * GIB)
    assert reading.non_torch_bytes == GIB


def test_describe_gpu_memory_gives_the_breakdown() -> None:
    line = describe_gpu_memory(fake_llama_profile(), 0.9, LLAMA_8B)
    assert line == (
        "Memory profiling: total_gpu_memory 79.647 GiB x gpu_memory_utilization 0.90 = 71.683 GiB; "
        "model weights (allocated before the pass) take 15.000 GiB; activation peak over the weights 1.514 GiB "
        "(forward 0.879, LM head 0.312, sampler 1.514 GiB); non_torch_memory takes 0.062 GiB (increase since "
        "the init snapshot; 0.500 GiB at the snapshot, CUDA context and other processes, left to the margin); "
        "the rest for the KV cache is 55.107 GiB = 28214 blocks of 2.00 MiB")
    starved = GpuMemoryProfile(80 * GIB, 80 * GIB, 0, 0, 15 * GIB)  # nothing left: zero blocks, no split
    assert describe_gpu_memory(starved, 0.9, LLAMA_8B).endswith("is -8.000 GiB = 0 blocks of 2.00 MiB")


def test_resolve_on_cuda_logs_the_breakdown(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="conveyor.worker.kv_cache"):
        blocks = resolve_num_blocks(LLAMA_8B, CacheConfig(gpu_memory_utilization=0.9), torch.device("cuda"),
                                    fake_llama_profile)
    assert blocks == 28214
    assert [r.getMessage() for r in caplog.records] == [describe_gpu_memory(fake_llama_profile(), 0.9, LLAMA_8B)]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="conveyor.worker.kv_cache"), pytest.raises(KVCacheSizingError):
        resolve_num_blocks(LLAMA_8B, CacheConfig(gpu_memory_utilization=0.2), torch.device("cuda"),
                           fake_llama_profile)
    assert "0 blocks" in caplog.records[0].getMessage()  # logged before the refusal: where the memory went


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

    def forward(end_stage: Callable[[], None]) -> int:
        scratch = torch.empty(64 << 20, dtype=torch.uint8, device=device)
        torch.empty(256 << 20, dtype=torch.uint8, device=device)
        end_stage()
        torch.empty(32 << 20, dtype=torch.uint8, device=device)
        end_stage()
        torch.empty(128 << 20, dtype=torch.uint8, device=device)
        end_stage()
        return scratch.numel()

    init = take_memory_snapshot(device)
    profile = profile_gpu_memory(device, forward, init)
    assert profile.peak_torch_bytes >= 256 << 20  # the scratch is left out, the activation is not
    assert profile.init_non_torch_bytes == init.non_torch_bytes > 0  # the CUDA context, left to the margin
    assert profile.non_torch_increase_bytes < 256 << 20  # the pass's tensors are torch's, not counted twice
    assert profile.total_bytes > profile.peak_torch_bytes
    assert profile.stages is not None  # each stage's own peak, not the running maximum
    assert profile.stages.forward_bytes - profile.weights_bytes >= 256 << 20
    assert (32 << 20) <= profile.stages.lm_head_bytes - profile.weights_bytes < 256 << 20
    assert (128 << 20) <= profile.stages.sampler_bytes - profile.weights_bytes < 256 << 20
