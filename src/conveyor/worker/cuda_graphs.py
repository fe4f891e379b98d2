"""CUDA graphs for decode steps: capture the forward once per padded batch size, replay it each step.

The model: a pure-decode step (every request computes one token and samples) of n requests runs the
graph captured for the smallest bucket B >= n (1, 2, 4, 8, then multiples of 16 up to
max_num_seqs, at most 512). Eager decode of a small model is CPU-bound -- hundreds of kernel launches
per step from Python -- while a replay is one launch. A graph reads fixed addresses, so its inputs
live in static device tensors, all views of ONE byte buffer laid out as
`input_ids | positions | slot_mapping (int64, B_max each) | seq_lens (int32) | block_tables (int32,
B_max x max_blocks)`; the host fills the same layout in a pinned buffer and each step makes ONE
host-to-device copy of the prefix it used. Padding rows (n..B) get slot -1 (store_kv skips it) and
seq_len 0 (attention writes zeros), so they never touch real KV blocks. `query_start_loc` is the
constant arange (token i is sequence i). Capture happens after the KV cache is allocated, largest
bucket first so that the smaller graphs reuse its memory pool. The attention backend chooses its
kernel from host ints only (max_query_len = 1, max_seq_len = max_model_len), so capture and replay agree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from conveyor.model.attention_metadata import AttentionMetadata
from conveyor.worker.input_batch import HostBatch

MAX_CAPTURE_SIZE = 512
"""Largest decode batch captured (vLLM's default as well)."""

ForwardFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
"""(input_ids [B], positions [B], metadata) -> hidden [B, H]: the model with its KV caches bound."""


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Buckets 1, 2, 4, 8, 16, 32, 48, ... up to min(max_num_seqs, 512), max_num_seqs itself included."""
    limit = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [s for s in [1, 2, 4, 8, *range(16, MAX_CAPTURE_SIZE + 1, 16)] if s <= limit]
    if sizes[-1] != limit:
        sizes.append(limit)
    return sizes


def decode_bucket(host: HostBatch, sizes: list[int], max_blocks_per_seq: int) -> int | None:
    """The bucket of a pure-decode step in which every request samples, else None (run it eagerly)."""
    num_reqs = host.seq_lens.shape[0]
    if host.num_tokens != num_reqs or len(host.sampling_rows) != num_reqs:
        return None
    if num_reqs > sizes[-1] or host.block_tables.shape[1] > max_blocks_per_seq:
        return None
    return next(size for size in sizes if size >= num_reqs)


@dataclass(frozen=True)
class GraphGeometry:
    """What fixes the static buffers' layout."""

    max_batch_size: int
    """Largest captured bucket."""
    max_blocks_per_seq: int
    """Block-table width: ceil(max_model_len / block_size)."""
    block_size: int
    max_model_len: int


class StaticInputs:
    """One pinned host byte buffer and one device byte buffer with the same layout, and typed views of both."""

    FIELDS = (("input_ids", np.int64), ("positions", np.int64), ("slot_mapping", np.int64), ("seq_lens", np.int32))

    def __init__(self, geometry: GraphGeometry, device: torch.device) -> None:
        self.geometry = geometry
        rows = geometry.max_batch_size
        self.offsets: dict[str, int] = {}
        offset = 0
        for name, dtype in self.FIELDS:
            self.offsets[name] = offset
            offset += -(-rows * np.dtype(dtype).itemsize // 16) * 16  # 16-byte aligned fields
        self.offsets["block_tables"] = offset
        self.num_bytes = offset + rows * geometry.max_blocks_per_seq * 4
        self.host = torch.zeros(self.num_bytes, dtype=torch.uint8, pin_memory=True)
        self.device_bytes = torch.zeros(self.num_bytes, dtype=torch.uint8, device=device)
        self.copy_done = torch.cuda.Event()
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)  # [B_max + 1]

    def device_view(self, name: str) -> torch.Tensor:
        return self._view(self.device_bytes, name)

    def host_view(self, name: str) -> np.ndarray:
        return self._view(self.host, name).numpy()

    def _view(self, buffer: torch.Tensor, name: str) -> torch.Tensor:
        rows, width = self.geometry.max_batch_size, self.geometry.max_blocks_per_seq
        start = self.offsets[name]
        if name == "block_tables":
            return buffer[start : start + rows * width * 4].view(torch.int32).view(rows, width)
        dtype = dict(self.FIELDS)[name]
        torch_dtype = torch.int64 if dtype is np.int64 else torch.int32
        return buffer[start : start + rows * np.dtype(dtype).itemsize].view(torch_dtype)

    def stage(self, host: HostBatch, batch_size: int) -> None:
        """Write the step (padded to batch_size) into the pinned buffer, then ONE copy to the device."""
        self.copy_done.synchronize()  # the previous step's copy has left the pinned buffer
        num_reqs = host.num_tokens
        for name, pad in (("input_ids", 0), ("positions", 0), ("slot_mapping", -1), ("seq_lens", 0)):
            view = self.host_view(name)
            view[:num_reqs] = getattr(host, name)
            view[num_reqs:batch_size] = pad
        width = host.block_tables.shape[1]
        self.host_view("block_tables")[:num_reqs, :width] = host.block_tables
        used = self.offsets["block_tables"] + batch_size * self.geometry.max_blocks_per_seq * 4
        self.device_bytes[:used].copy_(self.host[:used], non_blocking=True)
        self.copy_done.record()

    def metadata(self, batch_size: int) -> AttentionMetadata:
        """Metadata over the static views; host fields describe the capture (worst case) shape."""
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: batch_size + 1],
            seq_lens=self.device_view("seq_lens")[:batch_size],
            block_tables=self.device_view("block_tables")[:batch_size],
            slot_mapping=self.device_view("slot_mapping")[:batch_size],
            max_query_len=1,
            max_seq_len=self.geometry.max_model_len,
            query_lens_cpu=[1] * batch_size,
            seq_lens_cpu=[self.geometry.max_model_len] * batch_size,
            block_size=self.geometry.block_size,
        )


class CudaGraphRunner:
    """Captured decode graphs by bucket size; `run` replays one for an eligible step, else returns None."""

    def __init__(self, forward: ForwardFn, geometry: GraphGeometry, device: torch.device) -> None:
        self.forward = forward
        self.inputs = StaticInputs(geometry, device)
        self.sizes = capture_sizes(geometry.max_batch_size)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every bucket, largest first (its pool then serves the smaller ones)."""
        pool = torch.cuda.graph_pool_handle()
        ids, positions = self.inputs.device_view("input_ids"), self.inputs.device_view("positions")
        self.inputs.device_view("slot_mapping").fill_(-1)  # capture-time runs write no KV
        for size in reversed(self.sizes):
            metadata = self.inputs.metadata(size)
            self.forward(ids[:size], positions[:size], metadata)  # compile kernels, pick GEMM algos
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.forward(ids[:size], positions[:size], metadata)
            self.graphs[size] = (graph, hidden)
        torch.cuda.synchronize()

    def run(self, host: HostBatch) -> torch.Tensor | None:
        """hidden [n, H] of a replayed decode step, or None when the step is not graph-eligible."""
        size = decode_bucket(host, self.sizes, self.inputs.geometry.max_blocks_per_seq)
        if size is None:
            return None
        self.inputs.stage(host, size)
        graph, hidden = self.graphs[size]
        graph.replay()
        return hidden[: host.num_tokens]
