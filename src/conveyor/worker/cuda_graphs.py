"""CUDA graphs for decode and mixed steps: capture the forward once per padded bucket, replay it each step.

The model: eager steps of a model on a fast GPU are CPU-bound -- hundreds of kernel launches per step
from Python -- while a replay is one launch. Two kinds of graphs, both over the static inputs of
graph_inputs.py (which also explains the padding):
- a *pure-decode* step (every request computes one token and samples) of n requests replays the
  decode graph of the smallest bucket B >= n (vLLM's sizes: 1, 2, 4, multiples of 8 below 256, then
  of 16, up to max_num_seqs, at most 512), with the small-tile attention launch that decode wants;
- any other step of n <= max_cudagraph_capture_size tokens (prefill chunks, with or without decodes,
  and speculative verification steps: 1 + K query tokens and logits rows per request) replays the
  *mixed* graph of the smallest token bucket T >= n. The unified attention kernel's grid
  depends only on the token and sequence counts, which the padding fixes, so the whole forward --
  attention included -- is one graph (vLLM's FULL mode). Bigger steps run eagerly: there the GPU
  work dwarfs the launches.
Capture happens after the KV cache is allocated, largest graph first so that the smaller ones reuse
its memory pool. The attention backend chooses its kernel from host ints only (max_query_len: 1 for
decode, T for mixed; max_seq_len = max_model_len), so capture and replay agree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from conveyor.config import CUDAGraphMode
from conveyor.model.attention_metadata import AttentionMetadata
from conveyor.worker.graph_inputs import GraphGeometry, StaticInputs
from conveyor.worker.input_batch import HostBatch

MAX_CAPTURE_SIZE = 512
"""Largest decode batch captured (vLLM's default as well)."""

ForwardFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
"""(input_ids [T], positions [T], metadata) -> hidden [T, H]: the model with its KV caches bound."""


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Decode buckets as vLLM's default capture sizes: 1, 2, 4, multiples of 8 below 256, multiples of
    16 up to min(max_num_seqs, 512), that limit included."""
    limit = min(max_num_seqs, MAX_CAPTURE_SIZE)
    candidates = [1, 2, 4, *range(8, 256, 8), *range(256, MAX_CAPTURE_SIZE + 1, 16)]
    sizes = [s for s in candidates if s <= limit]
    if sizes[-1] != limit:
        sizes.append(limit)
    return sizes


def mixed_capture_sizes(max_num_tokens: int) -> list[int]:
    """Mixed-step token buckets: 16 .. 128 doubling, then steps of 128 to 1024 and of 256 beyond, so a
    step pads by fewer than 128 tokens, or a quarter of its bucket beyond 1024; `max_num_tokens` itself
    closes the list."""
    candidates = [16, 32, 64, 128, *range(256, 1025, 128), *range(1280, max_num_tokens + 1, 256)]
    sizes = [s for s in candidates if s <= max_num_tokens]
    if not sizes or sizes[-1] != max_num_tokens:
        sizes.append(max_num_tokens)
    return sizes


def decode_bucket(host: HostBatch, sizes: list[int], max_blocks_per_seq: int) -> int | None:
    """The bucket of a pure-decode step in which every request samples, else None."""
    num_reqs = host.seq_lens.shape[0]
    if host.num_tokens != num_reqs or len(host.sampling_rows) != num_reqs:
        return None
    if num_reqs > sizes[-1] or host.block_tables.shape[1] > max_blocks_per_seq:
        return None
    return next(size for size in sizes if size >= num_reqs)


def mixed_bucket(host: HostBatch, sizes: list[int], geometry: GraphGeometry) -> int | None:
    """The token bucket of a step that fits a mixed graph (room for its padding sequence), else None."""
    if not sizes or host.num_tokens > sizes[-1] or host.seq_lens.shape[0] >= geometry.max_seqs:
        return None
    if len(host.logits_indices) > geometry.max_logits_rows:  # more drafts than the graphs were built for
        return None
    if host.block_tables.shape[1] > geometry.max_blocks_per_seq:
        return None
    return next(size for size in sizes if size >= host.num_tokens)


@dataclass(frozen=True)
class GraphPlan:
    """Which graphs to capture."""

    max_num_seqs: int
    """The scheduler's max_num_seqs (decode buckets and the sequence rows of mixed graphs)."""
    max_num_batched_tokens: int
    """The scheduler's token budget (no step is larger)."""
    max_model_len: int
    block_size: int
    mode: CUDAGraphMode
    max_cudagraph_capture_size: int
    """Largest mixed-graph token bucket (capped by max_num_batched_tokens)."""
    num_speculative_tokens: int = 0
    """K under speculative decoding: a verifying request has 1 + K logits rows."""

    def geometry(self) -> GraphGeometry:
        decode, mixed = capture_sizes(self.max_num_seqs), self.mixed_sizes()
        max_tokens = max(decode[-1], mixed[-1] if mixed else 0)
        return GraphGeometry(
            max_tokens=max_tokens, max_seqs=self.max_num_seqs + 1,
            max_blocks_per_seq=-(-self.max_model_len // self.block_size), block_size=self.block_size,
            max_model_len=self.max_model_len,
            max_logits_rows=min(max_tokens, (self.max_num_seqs + 1) * (1 + self.num_speculative_tokens)),
        )

    def mixed_sizes(self) -> list[int]:
        if self.mode is CUDAGraphMode.FULL_DECODE_ONLY:
            return []
        return mixed_capture_sizes(min(self.max_cudagraph_capture_size, self.max_num_batched_tokens))


class CudaGraphRunner:
    """Captured graphs by kind and bucket; `run` replays one for an eligible step, else returns None."""

    def __init__(self, forward: ForwardFn, plan: GraphPlan, device: torch.device) -> None:
        self.forward = forward
        self.geometry = plan.geometry()
        self.inputs = StaticInputs(self.geometry, device)
        self.decode_sizes = capture_sizes(plan.max_num_seqs)
        self.mixed_sizes = plan.mixed_sizes()
        self.decode_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.mixed_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every bucket, largest first (its pool then serves the smaller ones)."""
        pool = torch.cuda.graph_pool_handle()
        self.inputs.reset_for_capture()
        jobs = [(size, self.mixed_graphs, self.inputs.mixed_metadata) for size in self.mixed_sizes]
        jobs += [(size, self.decode_graphs, self.inputs.decode_metadata) for size in self.decode_sizes]
        for size, graphs, metadata_for in sorted(jobs, key=lambda job: -job[0]):
            graphs[size] = self._capture_one(size, metadata_for, pool)
        torch.cuda.synchronize()

    def _capture_one(self, size: int, metadata_for: Callable[[int], AttentionMetadata],
                     pool: tuple[int, int]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        ids, positions = self.inputs.device_view("input_ids")[:size], self.inputs.device_view("positions")[:size]
        self.forward(ids, positions, metadata_for(size))  # compile kernels, pick GEMM algorithms
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # Fresh metadata for the capture: what a backend derived in the warm-up (its `backend_plan`, e.g.
        # the triton backend's decode order) must be computed inside the graph, so that each replay
        # recomputes it from the replayed inputs and its memory belongs to the graph's pool.
        with torch.cuda.graph(graph, pool=pool):
            hidden = self.forward(ids, positions, metadata_for(size))
        return graph, hidden

    def run(self, host: HostBatch, patch_input_ids: Callable[[torch.Tensor], None]) -> torch.Tensor | None:
        """Hidden rows [S, H] of the sampling requests, in order, from a replayed graph; None when the
        step fits no graph (the caller runs it eagerly). `patch_input_ids` edits the staged input ids
        [T] on the device before the replay (placeholder tokens of async scheduling)."""
        size = decode_bucket(host, self.decode_sizes, self.geometry.max_blocks_per_seq)
        if size is not None:
            self.inputs.stage(host, size, mixed=False)
            patch_input_ids(self.inputs.device_view("input_ids")[: host.num_tokens])
            graph, hidden = self.decode_graphs[size]
            graph.replay()
            return hidden[: host.num_tokens]  # every request samples, in batch order
        size = mixed_bucket(host, self.mixed_sizes, self.geometry)
        if size is None:
            return None
        self.inputs.stage(host, size, mixed=True)
        patch_input_ids(self.inputs.device_view("input_ids")[: host.num_tokens])
        graph, hidden = self.mixed_graphs[size]
        graph.replay()
        return hidden[self.inputs.device_view("logits_indices")[: len(host.logits_indices)]]
