"""Paged attention: the `Attention` module, its pluggable backends and the plain-torch reference.

KV cache layout, one tensor per layer, allocated by the worker with `kv_cache_shape`:

    kv_cache[0] = K, kv_cache[1] = V, each [num_blocks, block_size, num_kv_heads, head_dim]

so the flat slot `s = block_id * block_size + offset` addresses `kv_cache[:, s // block_size,
s % block_size]`. A step first writes this step's K/V into their slots (`write_kv`), then every
query token attends to positions `0 .. its own position` of its sequence, read through the block
table (`forward`). Writing first makes the chunk's own keys visible to itself, so a prefill chunk
with a cached prefix and a decode are the same computation with different query lengths.

With --kv-cache-dtype fp8 the cache tensors are float8 and each `Attention` layer carries its per-tensor
`KVScales` (vLLM's k_scale / v_scale, 1.0 unless calibrated): backends quantize on write (x / scale)
and dequantize on read (x * scale) with them (kernels/fp8_kv.py).

A backend in `STORE_KV_BACKENDS` writes with kernels/store_kv.py's `store_kv`; where `Attention.accepts_kv_from_rope`
holds (CUDA, that layout, this layer's heads) the model's rope kernel may store the step's K/V itself with the
same code, one launch fewer a layer, and passes `kv_stored=True` so that `forward` skips `write_kv`.

Backends are named in `ATTENTION_BACKENDS` (name -> "module:Class") and imported on demand, so a
new backend (e.g. "triton" in attention_triton.py) is a new file plus one line here.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.kernels.fp8_kv import (
    UNIT_KV_SCALES,
    KVScales,
    dequantize_kv,
    is_fp8,
    quantize_kv,
)
from conveyor.model.attention_metadata import AttentionMetadata

ATTENTION_BACKENDS: dict[str, str] = {
    "torch": "conveyor.model.attention:TorchAttentionBackend",
    "triton": "conveyor.model.attention_triton:TritonAttentionBackend",
    "cpu": "conveyor.model.attention_cpu:CPUAttentionBackend",
}
"""Registered backend names -> "module:Class" (a constant; classes take no constructor arguments)."""


STORE_KV_BACKENDS = frozenset({"triton"})
"""Backends whose `write_kv` is `store_kv(key, value, kv_cache[0], kv_cache[1], slot_mapping, scales=kv_scales)`:
a rope kernel that stores K/V through store_kv.py's code (kernels/rotary.py, qk_norm_rope.py) writes its bytes."""


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """Shape of ONE layer's KV cache tensor: [2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]."""
    return (2, num_blocks, block_size, num_kv_heads, head_dim)


class AttentionBackend(Protocol):
    """What `Attention` needs from a backend; implementations hold no per-step state."""

    name: str

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
        kv_scales: KVScales = UNIT_KV_SCALES,
    ) -> None:
        """Store key/value [num_tokens, num_kv_heads, head_dim] into kv_cache at slot_mapping [num_tokens]
        (an FP8 cache: divided by kv_scales first)."""
        ...

    def forward(
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
        kv_scales: KVScales = UNIT_KV_SCALES,
    ) -> torch.Tensor:
        """query [num_tokens, num_heads, head_dim] -> output of the same shape (causal, paged; an FP8
        cache read back times kv_scales)."""
        ...


def get_attention_backend(name: str) -> AttentionBackend:
    """A fresh backend instance by name ("torch", "triton"); unknown names raise with the choices."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(ATTENTION_BACKENDS)}")
    module_name, class_name = ATTENTION_BACKENDS[name].split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"attention backend {name!r} is not available here: {error}") from error
    return getattr(module, class_name)()


def write_kv_torch(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    kv_scales: KVScales = UNIT_KV_SCALES,
) -> None:
    """Scatter key/value [T, kvh, d] into the flat slots of kv_cache [2, nb, bs, kvh, d]."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    key = quantize_kv(key, kv_cache.dtype, kv_scales.k_scale)
    value = quantize_kv(value, kv_cache.dtype, kv_scales.v_scale)
    if is_fp8(kv_cache.dtype):  # index_copy_ has no float8 kernel on CPU: copy the bytes
        kv_cache, key, value = kv_cache.view(torch.uint8), key.view(torch.uint8), value.view(torch.uint8)
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


# Bytes of gathered K+V per decode group. Decodes are batched in groups of similar length whose
# padded gather stays under this: bounded padding waste, yet enough sequences per group that CPU
# SDPA has (sequences x KV heads) tasks to spread over its threads (one 800-token SmolLM2 sequence
# is only 3 tasks). `benchmarks/attention_torch_cpu.py` shapes, 2 threads: 1 MiB -> 4 MiB cut a
# layer's decode attention by 30-45 %; 16 MiB and more lose again to padding on mixed lengths.
DECODE_GROUP_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class _DecodeGroup:
    """One-token sequences attended together over a padded gather of their blocks."""

    token_ids: torch.Tensor
    """[n] int64: their rows in query / out."""
    block_ids: torch.Tensor
    """[n * num_blocks] int64: block tables cut to the group's longest sequence, flattened."""
    mask: torch.Tensor | None
    """[n, 1, 1, L] additive (0 / -inf) in the query dtype: key j of row i is real (None: no padding)."""


@dataclass(frozen=True)
class PrefillChunk:
    """A sequence with several query tokens (a prefill chunk, maybe after a cached prefix)."""

    tokens: slice
    """Its rows in query / out."""
    block_ids: torch.Tensor
    """[num_blocks] int64: the blocks holding its seq_len tokens."""
    seq_len: int
    """Context length including the chunk."""
    mask: torch.Tensor | None
    """[q, L] additive causal mask shifted by the cached context (None: no context, plain causal)."""


@dataclass(frozen=True)
class TorchAttentionPlan:
    """What the torch backend derives from one step's metadata, once, for every layer."""

    decode_groups: list[_DecodeGroup]
    """Decodes, in length-sorted groups."""
    prefill_chunks: list[PrefillChunk]
    """Multi-token queries, one by one."""
    gather_buffer: torch.Tensor
    """[2, max blocks any one gather reads, block_size, kvh, d] in the cache dtype: every layer's
    gathers land here (`index_select(out=)`), so a step allocates its K/V scratch once, not per
    layer and group (fresh megabyte buffers are page-faulted in anew on CPU)."""


def paged_attention_torch(
    query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
    kv_scales: KVScales = UNIT_KV_SCALES,
) -> torch.Tensor:
    """Reference paged attention: query [T, H, d] -> [T, H, d], K/V of this step already written.

    Single-token sequences (decodes) are batched in groups of similar length: their blocks are
    gathered into a padded [n, kvh, L, d] tensor and masked by length. Longer queries (prefill
    chunks) run one by one with a causal mask shifted by their cached context.
    GQA: query head h reads KV head h // (H // kvh). An FP8 cache is gathered as it is (half the bytes)
    and dequantized to the query's dtype after the gather.
    """
    plan = metadata.backend_plan
    if not isinstance(plan, TorchAttentionPlan):  # first layer of the step: plan once
        plan = metadata.backend_plan = plan_torch_attention(metadata, kv_cache, query.dtype)
    out = torch.empty_like(query)
    for group in plan.decode_groups:
        k, v = _read_kv(kv_cache, group.block_ids, plan.gather_buffer, (query.dtype, kv_scales))
        out[group.token_ids] = _decode_attention(query[group.token_ids], k, v, group, scale)
    for chunk in plan.prefill_chunks:
        k, v = _read_kv(kv_cache, chunk.block_ids, plan.gather_buffer, (query.dtype, kv_scales))
        out[chunk.tokens] = prefill_attention(query[chunk.tokens], k, v, chunk, scale)
    return out


def _read_kv(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, buffer: torch.Tensor, read_as: tuple[torch.dtype, KVScales]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gather_blocks`, then an FP8 cache's K and V [n, kvh, d] dequantized to `read_as`'s dtype."""
    k, v = gather_blocks(kv_cache, block_ids, buffer)
    if not is_fp8(kv_cache.dtype):
        return k, v  # cast where used, as before: 16/32-bit caches need no scale
    dtype, scales = read_as
    return dequantize_kv(k, dtype, scales.k_scale), dequantize_kv(v, dtype, scales.v_scale)


def plan_torch_attention(
    metadata: AttentionMetadata, kv_cache: torch.Tensor, dtype: torch.dtype
) -> TorchAttentionPlan:
    """Group the decodes (see DECODE_GROUP_BYTES), prepare index tensors, masks (in `dtype`) and the buffer."""
    device = metadata.block_tables.device
    starts = [0]
    for length in metadata.query_lens_cpu:
        starts.append(starts[-1] + length)
    groups = []
    decodes = [i for i, q in enumerate(metadata.query_lens_cpu) if q == 1]
    token_bytes = 2 * kv_cache[0, 0, 0].numel() * kv_cache.element_size()
    for seqs in _decode_groups(decodes, metadata.seq_lens_cpu, token_bytes):
        lens = [metadata.seq_lens_cpu[i] for i in seqs]
        num_blocks = math.ceil(lens[0] / metadata.block_size)  # lens[0] is the group's longest
        rows = torch.tensor(seqs, device=device)
        mask = None
        if min(lens) < num_blocks * metadata.block_size:
            key_pos = torch.arange(num_blocks * metadata.block_size, device=device)
            mask = _additive((key_pos[None, :] < torch.tensor(lens, device=device)[:, None])[:, None, None, :], dtype)
        token_ids = torch.tensor([starts[i] for i in seqs], device=device)
        block_ids = metadata.block_tables[rows, :num_blocks].long().reshape(-1)
        groups.append(_DecodeGroup(token_ids, block_ids, mask))
    chunks = [
        plan_prefill_chunk(metadata, i, slice(starts[i], starts[i + 1]), dtype)
        for i, q in enumerate(metadata.query_lens_cpu) if q > 1
    ]
    max_blocks = max(item.block_ids.numel() for item in [*groups, *chunks])
    buffer = torch.empty((2, max_blocks, *kv_cache.shape[2:]), dtype=kv_cache.dtype, device=device)
    return TorchAttentionPlan(decode_groups=groups, prefill_chunks=chunks, gather_buffer=buffer)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool mask -> 0 where allowed, -inf elsewhere: what SDPA would convert it to in every call."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def plan_prefill_chunk(metadata: AttentionMetadata, seq: int, tokens: slice, dtype: torch.dtype) -> PrefillChunk:
    device = metadata.block_tables.device
    seq_len = metadata.seq_lens_cpu[seq]
    num_context = seq_len - metadata.query_lens_cpu[seq]
    block_ids = metadata.block_tables[seq, : math.ceil(seq_len / metadata.block_size)].long()
    mask = None
    if num_context > 0:
        # Query i sits at position num_context + i and sees keys 0 .. num_context + i.
        key_pos = torch.arange(seq_len, device=device)
        query_pos = torch.arange(num_context, seq_len, device=device)
        mask = _additive(key_pos[None, :] <= query_pos[:, None], dtype)  # [q, L]
    return PrefillChunk(tokens=tokens, block_ids=block_ids, seq_len=seq_len, mask=mask)


def _decode_groups(seqs: list[int], seq_lens: list[int], kv_token_bytes: int) -> list[list[int]]:
    """Split decode sequences, longest first, into groups whose padded K+V gather fits the budget."""
    groups: list[list[int]] = []
    for i in sorted(seqs, key=lambda i: -seq_lens[i]):
        if groups:
            padded_len = seq_lens[groups[-1][0]]  # the group's first is its longest
            if (len(groups[-1]) + 1) * padded_len * kv_token_bytes <= DECODE_GROUP_BYTES:
                groups[-1].append(i)
                continue
        groups.append([i])
    return groups


def gather_blocks(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, buffer: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """block_ids [nblk] -> K and V [nblk * block_size, kvh, d] in block order, views of `buffer`."""
    count = block_ids.numel()
    k = torch.index_select(kv_cache[0], 0, block_ids, out=buffer[0, :count])  # [nblk, bs, kvh, d]
    v = torch.index_select(kv_cache[1], 0, block_ids, out=buffer[1, :count])
    return k.flatten(0, 1), v.flatten(0, 1)


def _decode_attention(
    query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: _DecodeGroup, scale: float
) -> torch.Tensor:
    """query [n, H, d] of n one-token sequences, k/v [n * L, kvh, d] their padded keys -> [n, H, d]."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k.shape[-2]
    k = k.view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2).to(query.dtype)  # [n, kvh, L, d]
    v = v.view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2).to(query.dtype)
    # The query heads sharing one KV head act as that head's "query length": no KV repeat needed.
    q = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [n, kvh, g, d]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)


def prefill_attention(
    query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: PrefillChunk, scale: float
) -> torch.Tensor:
    """query [q, H, d] of one sequence (its last q positions), k/v [L', kvh, d] its gathered blocks -> [q, H, d].

    GQA without `enable_gqa` (which sends CPU SDPA to its unfused math path, ~4x slower here):
    the KV heads are the batch and each one's query heads its heads, K/V broadcast over them
    with a stride-0 expand, so the fused kernel runs and nothing is copied.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k.shape[-2]
    group = num_heads // num_kv_heads
    kv_shape = (num_kv_heads, group, chunk.seq_len, head_dim)
    k = k[: chunk.seq_len].to(query.dtype).permute(1, 0, 2)[:, None].expand(kv_shape)  # [kvh, g, L, d]
    v = v[: chunk.seq_len].to(query.dtype).permute(1, 0, 2)[:, None].expand(kv_shape)
    q = query.view(num_tokens, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [kvh, g, q, d]
    causal = chunk.mask is None
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=chunk.mask, is_causal=causal, scale=scale)
    return out.permute(2, 0, 1, 3).reshape(num_tokens, num_heads, head_dim)


class TorchAttentionBackend:
    """The reference backend: plain torch, CPU and GPU."""

    name = "torch"

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
        kv_scales: KVScales = UNIT_KV_SCALES,
    ) -> None:
        write_kv_torch(key, value, kv_cache, slot_mapping, kv_scales)

    def forward(
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
        kv_scales: KVScales = UNIT_KV_SCALES,
    ) -> torch.Tensor:
        return paged_attention_torch(query, kv_cache, metadata, scale, kv_scales)


class Attention(nn.Module):
    """Multi-head (GQA) attention over the paged KV cache; projections and rope live in the caller."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, backend: AttentionBackend,
                 kv_scales: KVScales = UNIT_KV_SCALES) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.backend = backend
        self.kv_scales = kv_scales
        """This layer's per-tensor K/V scales for an FP8 cache (vLLM's default 1.0: no calibration)."""

    def accepts_kv_from_rope(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """Whether a rope kernel may store this step's key/value [T, kvh, d] in place of `write_kv` (the caller
        then passes kv_stored=True): a `STORE_KV_BACKENDS` backend, CUDA tensors, the cache [2, nb, bs, kvh, d]
        of this layer's heads with rows contiguous in d, and a cache dtype of key's or FP8 (the torch and CPU
        backends, and anything else, keep `write_kv`)."""
        heads = (self.num_kv_heads, self.head_dim)
        return (self.backend.name in STORE_KV_BACKENDS and key.is_cuda and value.is_cuda and kv_cache.is_cuda
                and kv_cache.dim() == 5 and kv_cache.shape[0] == 2 and tuple(kv_cache.shape[3:]) == heads
                and tuple(key.shape[1:]) == tuple(value.shape[1:]) == heads and key.dtype == value.dtype
                and key.stride(-1) == value.stride(-1) == kv_cache.stride(-1) == 1
                and (kv_cache.dtype == key.dtype or is_fp8(kv_cache.dtype)))

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        """query [T, H*d], key/value [T, kvh*d] -> [T, H*d]; writes this step's K/V first, unless `kv_stored`
        (a rope kernel already stored them, where `accepts_kv_from_rope` allowed it)."""
        num_tokens = query.shape[0]
        if not kv_stored:
            key = key.view(num_tokens, self.num_kv_heads, self.head_dim)
            value = value.view(num_tokens, self.num_kv_heads, self.head_dim)
            self.backend.write_kv(key, value, kv_cache, metadata.slot_mapping, self.kv_scales)
        query = query.view(num_tokens, self.num_heads, self.head_dim)
        out = self.backend.forward(query, kv_cache, metadata, self.scale, self.kv_scales)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)
