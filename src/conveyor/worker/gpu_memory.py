"""What the device's memory holds, read as vLLM's worker reads it: a snapshot when the device is up, before
the weights load, and a profile around the profiling pass of the largest batch.

Memory outside torch's allocator (the CUDA context, NCCL, lazily loaded kernel modules, other processes)
is counted only by its increase since the snapshot (vLLM's `memory_profiling`): what was already in use
at the snapshot, the context above all (~0.5 GiB), lives in the 1 - gpu_memory_utilization margin. In
exchange, start-up refuses to run when the free memory at the snapshot is below the requested share of
the device (vLLM's `request_memory`), so the margin really holds what it is charged with.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

GIB = 1 << 30


class GpuMemoryStartupError(RuntimeError):
    """Less memory is free at start-up than --gpu-memory-utilization asks for; says what to change."""


@dataclass(frozen=True)
class MemorySnapshot:
    """The device's memory at one moment (bytes)."""

    free_bytes: int
    """Free on the device (torch.cuda.mem_get_info), whoever holds the rest."""
    total_bytes: int
    """The device's memory."""
    torch_reserved_bytes: int
    """What torch's caching allocator holds from the driver."""
    torch_allocated_bytes: int
    """What live tensors take of that."""

    @property
    def non_torch_bytes(self) -> int:
        """In use, but not by torch's allocator: the CUDA context, NCCL, kernel modules, other processes."""
        return self.total_bytes - self.free_bytes - self.torch_reserved_bytes


def take_memory_snapshot(device: torch.device) -> MemorySnapshot:
    """Read the device now; freed tensors go back to the driver first, so they do not count as torch's."""
    gc.collect()
    torch.cuda.synchronize(device)  # creates the context if nothing has: it belongs to the snapshot
    torch.cuda.empty_cache()
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    return MemorySnapshot(free_bytes, total_bytes, torch.cuda.memory_reserved(device),
                          torch.cuda.memory_allocated(device))


def requested_memory_bytes(snapshot: MemorySnapshot, gpu_memory_utilization: float) -> int:
    """vLLM's start-up check: the requested share of the device, ceil(total x utilization), must be free at
    the snapshot; otherwise the margin already holds more than the context and the engine refuses to start."""
    requested = math.ceil(snapshot.total_bytes * gpu_memory_utilization)
    if snapshot.free_bytes < requested:
        raise GpuMemoryStartupError(
            f"free GPU memory at start-up ({snapshot.free_bytes / GIB:.2f}/{snapshot.total_bytes / GIB:.2f} GiB) "
            f"is less than --gpu-memory-utilization {gpu_memory_utilization} asks for "
            f"({requested / GIB:.2f} GiB); lower --gpu-memory-utilization or free the memory other processes hold"
        )
    return requested


@dataclass(frozen=True)
class ProfileStagePeaks:
    """torch's allocated peak within each stage of the profiling pass, the scratch KV left out (bytes, the
    weights included): the peak is reset between stages, so each figure is that stage's own."""

    forward_bytes: int
    """The forward of max_num_batched_tokens tokens (the sampled rows gathered, the hidden states freed)."""
    lm_head_bytes: int
    """The LM head over the sampled rows: their logits in the model's dtype."""
    sampler_bytes: int
    """The sampler's step over those logits (its float32 copy, noise and row-chunk temporaries)."""


@dataclass(frozen=True)
class GpuMemoryProfile:
    """Memory measured around a profiling forward pass on CUDA."""

    total_bytes: int
    """Device memory (torch.cuda.mem_get_info total)."""
    peak_torch_bytes: int
    """torch.cuda.max_memory_allocated after the profiling pass, less the scratch KV the pass held:
    weights + peak activations (the real KV cache is budgeted on its own, as vLLM profiles without one)."""
    non_torch_bytes: int
    """Memory in use that torch's allocator does not own, after the pass (CUDA context, NCCL, kernel
    modules, other processes)."""
    init_non_torch_bytes: int
    """The same at the snapshot taken before the weights loaded: not charged to the budget."""
    weights_bytes: int
    """torch.cuda.memory_allocated before the pass: the weights and every buffer allocated since (vLLM's
    "model weights take"); the pass's peak above it is the activation peak."""
    stages: ProfileStagePeaks | None = None
    """The peak of each stage of the pass, where the pass marked its stages."""

    @property
    def activation_peak_bytes(self) -> int:
        """What the pass added at its peak over what was allocated before it."""
        return self.peak_torch_bytes - self.weights_bytes

    @property
    def non_torch_increase_bytes(self) -> int:
        """Memory outside torch that this engine added since the snapshot; never negative, so memory another
        process released meanwhile cannot lend the KV cache bytes that are not ours."""
        return max(0, self.non_torch_bytes - self.init_non_torch_bytes)

    def budget_bytes(self, gpu_memory_utilization: float) -> int:
        return int(self.total_bytes * gpu_memory_utilization)

    def kv_cache_bytes(self, gpu_memory_utilization: float) -> int:
        """What the utilization target leaves after the profiled peak and the growth of memory outside torch
        (vLLM's rule); negative when nothing is left."""
        return (self.budget_bytes(gpu_memory_utilization) - self.peak_torch_bytes
                - self.non_torch_increase_bytes)


def profile_from_peaks(after: MemorySnapshot, init: MemorySnapshot, weights_bytes: int, peaks: list[int],
                       scratch_bytes: int) -> GpuMemoryProfile:
    """The profile from torch's allocated peaks read during the pass: one per stage the pass marked, then one
    for whatever ran after its last mark. The scratch KV is alive in every stage, so it leaves each of them."""
    peak_torch_bytes = max(peaks) - scratch_bytes
    stages = None
    if len(peaks) == 4:  # forward, LM head, sampler, the rest of the pass
        stages = ProfileStagePeaks(*(peak - scratch_bytes for peak in peaks[:3]))
    return GpuMemoryProfile(after.total_bytes, peak_torch_bytes, after.non_torch_bytes, init.non_torch_bytes,
                            weights_bytes, stages)


def profile_gpu_memory(device: torch.device, run_forward: Callable[[Callable[[], None]], int],
                       init: MemorySnapshot) -> GpuMemoryProfile:
    """Run `run_forward` (the largest batch) once and measure torch's peak and memory outside torch.

    `run_forward(end_stage)` calls `end_stage()` at the end of each of its stages (forward, LM head,
    sampler), which reads the peak so far and resets it, so the profile also has each stage's peak. It
    returns the bytes of scratch KV it allocated. They are taken off the peak: the real cache replaces them
    and is sized separately, so counting them would shrink the cache by their size (2 GiB for a 32B model at
    8,192 tokens, the whole KV budget of an 80 GB card at vLLM's defaults). Memory outside torch is read
    after the pass, as vLLM does: kernel modules and workspaces the pass loaded are part of it."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    weights_bytes = torch.cuda.memory_allocated(device)
    peaks: list[int] = []

    def end_stage() -> None:
        torch.cuda.synchronize(device)
        peaks.append(torch.cuda.max_memory_allocated(device))
        torch.cuda.reset_peak_memory_stats(device)  # the next stage's peak starts from what is allocated now

    scratch_bytes = run_forward(end_stage)
    end_stage()  # whatever ran after the pass's last stage
    return profile_from_peaks(take_memory_snapshot(device), init, weights_bytes, peaks, scratch_bytes)
