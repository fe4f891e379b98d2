"""The start-up memory check (vLLM's `request_memory`) and the runner's init snapshot, on CPU with fake readings."""

from __future__ import annotations

import types

import pytest
import torch

from conveyor.config import CacheConfig
from conveyor.worker import model_runner
from conveyor.worker.gpu_memory import (
    GpuMemoryStartupError,
    MemorySnapshot,
    requested_memory_bytes,
)
from conveyor.worker.model_runner import ModelRunner

GIB = 1 << 30
TOTAL = 85_520_809_984  # the pair's H100


def reading(free_bytes: int) -> MemorySnapshot:
    return MemorySnapshot(free_bytes=free_bytes, total_bytes=TOTAL, torch_reserved_bytes=0, torch_allocated_bytes=0)


def test_requested_memory_is_vllms_ceiling_and_must_be_free() -> None:
    requested = -(-TOTAL * 9 // 10)  # ceil(total x 0.9), vLLM's requested_memory
    assert requested_memory_bytes(reading(requested), 0.9) == requested  # exactly enough is enough
    with pytest.raises(GpuMemoryStartupError) as refused:
        requested_memory_bytes(reading(requested - 1), 0.9)
    message = str(refused.value)
    assert "\n" not in message
    assert message == (
        "free GPU memory at start-up (71.68/79.65 GiB) is less than --gpu-memory-utilization 0.9 asks for "
        "(71.68 GiB); lower --gpu-memory-utilization or free the memory other processes hold")


def test_a_context_fits_in_the_margin_but_another_process_may_not() -> None:
    context = GIB // 2
    assert requested_memory_bytes(reading(TOTAL - context), 0.9) > 0
    with pytest.raises(GpuMemoryStartupError, match="0.95"):
        requested_memory_bytes(reading(TOTAL - context - 4 * GIB), 0.95)  # a neighbour holds 4 GiB


def runner_shell(cache_config: CacheConfig, device: str = "cuda") -> ModelRunner:
    """Just what `_init_memory_snapshot` reads of a runner: its device and cache config (no CUDA needed)."""
    return types.SimpleNamespace(device=torch.device(device), cache_config=cache_config)  # type: ignore[return-value]


def test_the_runner_checks_at_its_snapshot_only_when_the_utilization_sizes_the_cache(
        monkeypatch: pytest.MonkeyPatch) -> None:
    crowded = reading(TOTAL // 2)  # half the device held by someone else
    monkeypatch.setattr(model_runner, "take_memory_snapshot", lambda device: crowded)
    with pytest.raises(GpuMemoryStartupError, match="--gpu-memory-utilization 0.9"):
        ModelRunner._init_memory_snapshot(runner_shell(CacheConfig()))
    # --kv-cache-memory and --num-gpu-blocks-override keep their precedence: the utilization sizes nothing.
    assert ModelRunner._init_memory_snapshot(runner_shell(CacheConfig(kv_cache_memory_bytes=GIB))) is crowded
    assert ModelRunner._init_memory_snapshot(runner_shell(CacheConfig(num_blocks_override=8))) is crowded
    assert ModelRunner._init_memory_snapshot(runner_shell(CacheConfig(), device="cpu")) is None
