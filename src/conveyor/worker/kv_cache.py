"""KV cache sizing and allocation: how many blocks fit in a memory budget, and the tensors that hold them.

The model: the KV cache is one tensor per layer, `[2, num_blocks, block_size, num_kv_heads, head_dim]`
(K and V planes), addressed by a global slot `block_id * block_size + offset`. One block therefore
costs `2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes` over all layers, and the
number of blocks is the budget divided by that, floored. The budget is, in order of precedence:
`CacheConfig.num_blocks_override` (exact count), `CacheConfig.kv_cache_memory_bytes`, and otherwise
1 GiB on CPU or, on CUDA, `total * gpu_memory_utilization - peak_torch_bytes - non-torch increase`
measured around a profiling forward of the largest batch (vLLM's procedure; the increase is over the
snapshot the runner takes before the weights load, gpu_memory.py). The scheduler's block
pool is sized with the same number, so the two can never disagree. `--kv-cache-dtype fp8` stores
one byte per element instead of bf16's two (kernels/fp8_kv.py), so the same budget holds twice the
blocks; `conveyor plan --kv-cache-dtype fp8` does the same arithmetic (tests/worker/test_kv_cache_fp8.py).
On CUDA the sizing logs one line (`describe_gpu_memory`): the budget, the weights, the pass's peak over
them split into forward / LM head / sampler, the memory outside torch and the blocks that are left.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from conveyor.config import CacheConfig
from conveyor.kernels.fp8_kv import FP8_KV_DTYPES
from conveyor.model.attention import kv_cache_shape
from conveyor.worker.gpu_memory import GpuMemoryProfile

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_MEMORY_BYTES = 1 << 30
"""KV budget on CPU when `--kv-cache-memory` is not given: 1 GiB."""


class KVCacheSizingError(RuntimeError):
    """The memory budget cannot hold even one block, or one max-length request; says what to change."""


@dataclass(frozen=True)
class KVCacheSpec:
    """The geometry of the paged KV cache of one model."""

    num_layers: int
    """Attention layers, each with its own cache tensor."""
    num_kv_heads: int
    """Key/value heads per layer (fewer than query heads under GQA)."""
    head_dim: int
    """Channels per head."""
    block_size: int
    """Tokens per block."""
    dtype_bytes: int
    """Bytes per element of the cache dtype (1 for fp8, 2 for bfloat16/float16, 4 for float32)."""

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's cache tensor, as the model's attention reads it."""
        return kv_cache_shape(num_blocks, self.block_size, self.num_kv_heads, self.head_dim)


class BlockCost(Protocol):
    """What sizing needs: the bytes one block costs over every cache that uses it."""

    @property
    def bytes_per_block(self) -> int: ...


@dataclass(frozen=True)
class SharedBlocksSpec:
    """Caches that share one block table (the target's and a speculative draft model's): a block of
    the pool is a block in each of them."""

    specs: tuple[KVCacheSpec, ...]

    @property
    def bytes_per_block(self) -> int:
        return sum(spec.bytes_per_block for spec in self.specs)


@dataclass(frozen=True)
class KVCapacity:
    """What the allocated KV cache can hold; printed by the server at start-up."""

    num_blocks: int
    """Blocks in the pool (the scheduler's block pool gets the same number)."""
    block_size: int
    """Tokens per block."""
    num_bytes: int
    """Memory taken by the cache tensors over all layers."""
    max_model_len: int
    """The longest request the engine accepts, used for the concurrency figure."""

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        """How many requests of max_model_len tokens fit at once (vLLM's start-up line)."""
        blocks_per_request = -(-self.max_model_len // self.block_size)
        return self.num_blocks / blocks_per_request

    def describe(self) -> str:
        return (
            f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = {self.num_tokens} tokens, "
            f"{self.num_bytes / (1 << 20):.1f} MiB; maximum concurrency for {self.max_model_len} "
            f"tokens per request: {self.max_concurrency:.2f}x"
        )


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 30):.3f}"


def describe_gpu_memory(profile: GpuMemoryProfile, gpu_memory_utilization: float, spec: BlockCost) -> str:
    """The start-up line of the sizing, in the spirit of vLLM's "Memory profiling takes ..." line: what the
    budget is, what the profile took out of it, and what is left for the KV cache."""
    kv_bytes = profile.kv_cache_bytes(gpu_memory_utilization)
    num_blocks = max(0, kv_bytes // spec.bytes_per_block)
    stages = profile.stages
    split = ""
    if stages is not None:  # each stage's peak above the weights: which one sets the activation peak
        over = [peak - profile.weights_bytes for peak in
                (stages.forward_bytes, stages.lm_head_bytes, stages.sampler_bytes)]
        split = f" (forward {_gib(over[0])}, LM head {_gib(over[1])}, sampler {_gib(over[2])} GiB)"
    return (
        f"Memory profiling: total_gpu_memory {_gib(profile.total_bytes)} GiB x gpu_memory_utilization "
        f"{gpu_memory_utilization:.2f} = {_gib(profile.budget_bytes(gpu_memory_utilization))} GiB; "
        f"model weights (allocated before the pass) take {_gib(profile.weights_bytes)} GiB; "
        f"activation peak over the weights {_gib(profile.activation_peak_bytes)} GiB{split}; "
        f"non_torch_memory takes {_gib(profile.non_torch_increase_bytes)} GiB (increase since the init "
        f"snapshot; {_gib(profile.init_non_torch_bytes)} GiB at the snapshot, CUDA context and other "
        f"processes, left to the margin); the rest for the KV cache is "
        f"{_gib(kv_bytes)} GiB = {num_blocks} blocks of {spec.bytes_per_block / (1 << 20):.2f} MiB"
    )


def dtype_num_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def resolve_kv_cache_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """--kv-cache-dtype as the cache tensors' element type: auto is the model's dtype."""
    if cache_dtype == "auto":
        return model_dtype
    return FP8_KV_DTYPES[cache_dtype]


def num_blocks_from_memory(spec: BlockCost, kv_cache_memory_bytes: int) -> int:
    """Blocks that fit in `kv_cache_memory_bytes` (floored); raises if not even one fits."""
    num_blocks = kv_cache_memory_bytes // spec.bytes_per_block
    if num_blocks < 1:
        raise KVCacheSizingError(
            f"kv_cache_memory_bytes ({kv_cache_memory_bytes}) is smaller than one KV block "
            f"({spec.bytes_per_block} bytes); raise --kv-cache-memory"
        )
    return num_blocks


def num_blocks_for_gpu(spec: BlockCost, gpu_memory_utilization: float, profile: GpuMemoryProfile) -> int:
    """Blocks that fit in what the utilization target leaves after the profiled peak (vLLM's rule)."""
    free_for_kv = profile.kv_cache_bytes(gpu_memory_utilization)
    if free_for_kv < spec.bytes_per_block:
        raise KVCacheSizingError(
            f"no GPU memory left for the KV cache: {gpu_memory_utilization:.2f} x "
            f"{profile.total_bytes / (1 << 30):.1f} GiB minus the model's peak "
            f"{profile.peak_torch_bytes / (1 << 30):.2f} GiB and {profile.non_torch_increase_bytes / (1 << 30):.2f} "
            "GiB outside torch; raise --gpu-memory-utilization or lower --max-num-batched-tokens"
        )
    return free_for_kv // spec.bytes_per_block


def sizes_from_gpu_memory_utilization(cache_config: CacheConfig) -> bool:
    """Whether --gpu-memory-utilization sets the budget: no block count and no --kv-cache-memory given."""
    return cache_config.num_blocks_override is None and cache_config.kv_cache_memory_bytes is None


def resolve_num_blocks(
    spec: BlockCost, cache_config: CacheConfig, device: torch.device,
    profile: Callable[[], GpuMemoryProfile] | None = None,
) -> int:
    """Apply the precedence of the module docstring; `profile` is called only on CUDA when needed."""
    if cache_config.num_blocks_override is not None:
        return cache_config.num_blocks_override
    if cache_config.kv_cache_memory_bytes is not None:
        return num_blocks_from_memory(spec, cache_config.kv_cache_memory_bytes)
    if device.type == "cuda":
        if profile is None:
            raise ValueError("sizing the KV cache from gpu_memory_utilization needs a profiling pass")
        measured = profile()
        # Logged before the check, so a budget too small to hold one block still says where it went.
        logger.info(describe_gpu_memory(measured, cache_config.gpu_memory_utilization, spec))
        return num_blocks_for_gpu(spec, cache_config.gpu_memory_utilization, measured)
    return num_blocks_from_memory(spec, DEFAULT_CPU_KV_CACHE_MEMORY_BYTES)


def check_fits_max_model_len(capacity: KVCapacity) -> None:
    """A request of max_model_len tokens must fit in the pool on its own, or it could never finish."""
    if capacity.max_concurrency < 1.0:
        raise KVCacheSizingError(
            f"the KV cache holds {capacity.num_tokens} tokens, fewer than max_model_len "
            f"({capacity.max_model_len}); raise --kv-cache-memory / --gpu-memory-utilization "
            "or lower --max-model-len"
        )


def allocate_kv_caches(
    spec: KVCacheSpec, num_blocks: int, device: torch.device, dtype: torch.dtype
) -> list[torch.Tensor]:
    """One zeroed tensor per layer, [2, num_blocks, block_size, num_kv_heads, head_dim]."""
    if dtype_num_bytes(dtype) != spec.dtype_bytes:
        raise ValueError(f"dtype {dtype} does not have spec.dtype_bytes={spec.dtype_bytes}")
    shape = spec.layer_shape(num_blocks)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]
