"""The "triton" attention backend: our paged kernels behind the `AttentionBackend` protocol.

K/V of the step go to the cache with `store_kv` (negative slots = CUDA-graph padding, skipped), or, where
the model's rope kernel stored them with the same code (attention.py's STORE_KV_BACKENDS), not again. A batch
that is all decodes and too small to fill the GPU (num_seqs * num_kv_heads programs under two waves)
with contexts long enough to split runs the split-KV kernel; everything else, mixed prefill/decode
batches included, runs the unified kernel (two launches for a mixed batch: see unified_attention.py).
The choice reads only host ints of the metadata (`max_query_len`, `max_seq_len`, tensor shapes), so it
is the same at CUDA-graph capture and replay. An FP8 cache (--kv-cache-dtype fp8) is written and read
by the same kernels with the layer's `KVScales`, plain floats baked into a captured graph like `scale`.
The unified kernel's decode programs run longest context first (DECODE_ORDER_NOTE in
kernels/unified_attention.py): the step's order is one device sort, made by the first layer and kept in
the metadata's `backend_plan` for the others (inside a captured graph, the sort is captured too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conveyor.kernels.fp8_kv import UNIT_KV_SCALES, KVScales
from conveyor.kernels.paged_batch import PagedBatch
from conveyor.kernels.split_kv_attention import SplitKVParams, choose_num_splits, split_kv_attention
from conveyor.kernels.store_kv import store_kv
from conveyor.kernels.triton_compat import HAS_TRITON
from conveyor.kernels.unified_attention import decode_order_of, unified_attention
from conveyor.model.attention_metadata import AttentionMetadata

if not HAS_TRITON:
    raise ImportError("the triton attention backend needs the `triton` package (and a CUDA GPU)")


@dataclass(frozen=True)
class TritonStepPlan:
    """What the triton backend derives once a step and every layer reuses."""

    decode_order: torch.Tensor
    """[num_seqs] int64: the sequences longest first (`decode_order_of`)."""


def step_plan(metadata: AttentionMetadata) -> TritonStepPlan:
    """The step's plan, made by the first layer that asks (metadata is built anew each step)."""
    plan = metadata.backend_plan
    if not isinstance(plan, TritonStepPlan):
        plan = metadata.backend_plan = TritonStepPlan(decode_order_of(metadata.seq_lens))
    return plan


class TritonAttentionBackend:
    """Paged attention with the Triton kernels of `conveyor.kernels` (CUDA, bf16/fp16 or FP8 caches)."""

    name = "triton"

    def __init__(self) -> None:
        self._num_sms: int | None = None  # read from the device on first use

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
        kv_scales: KVScales = UNIT_KV_SCALES,
    ) -> None:
        store_kv(key, value, kv_cache[0], kv_cache[1], slot_mapping, scales=kv_scales)

    def forward(
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
        kv_scales: KVScales = UNIT_KV_SCALES,
    ) -> torch.Tensor:
        batch = PagedBatch(
            block_tables=metadata.block_tables, seq_lens=metadata.seq_lens,
            query_start_loc=metadata.query_start_loc, max_query_len=metadata.max_query_len,
            max_seq_len=metadata.max_seq_len,
        )
        num_splits = self._num_splits(query, kv_cache, batch)
        if num_splits > 1:
            params = SplitKVParams(scale=scale, num_splits=num_splits, kv_scales=kv_scales)
            return split_kv_attention(query, kv_cache[0], kv_cache[1], batch, params)
        return unified_attention(query, kv_cache[0], kv_cache[1], batch, scale, kv_scales=kv_scales,
                                 decode_order=step_plan(metadata).decode_order)

    def _num_splits(self, query: torch.Tensor, kv_cache: torch.Tensor, batch: PagedBatch) -> int:
        """1 (unified kernel) unless this is a decode-only batch too small to fill the GPU."""
        if batch.max_query_len != 1 or query.shape[0] != batch.num_seqs:
            return 1
        if self._num_sms is None:
            self._num_sms = torch.cuda.get_device_properties(query.device).multi_processor_count
        return choose_num_splits(batch.num_seqs, kv_cache.shape[-2], batch.max_seq_len, self._num_sms)
