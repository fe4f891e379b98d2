"""One step's model inputs for the whole mixed batch, built on the host in one go, then moved once.

Request `i` of the batch computes `query_lens[i]` tokens starting at position `num_computed[i]`:
its tokens `token_ids[start:start + n]`, positions `start .. start + n - 1`, and cache slots
`block_ids[pos // block_size] * block_size + pos % block_size`. The flat token axis concatenates
requests in batch order (vLLM's varlen layout; no padding). A request samples iff its range reaches
the end of its known tokens; its logits row is the hidden state of its last token.

Everything is computed with numpy over the whole batch, then each field becomes ONE tensor and, on
CUDA, ONE host→device copy through a pinned staging buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from conveyor.model.attention_metadata import AttentionMetadata
from conveyor.worker.request_state import RequestState


@dataclass(frozen=True)
class HostBatch:
    """The step's inputs as numpy arrays (host side)."""

    input_ids: np.ndarray
    """[T] int64 token ids."""
    positions: np.ndarray
    """[T] int64 positions within each sequence."""
    slot_mapping: np.ndarray
    """[T] int64 cache slot of each token."""
    query_start_loc: np.ndarray
    """[B + 1] int32 cumulative query lengths."""
    seq_lens: np.ndarray
    """[B] int32 context length after this step."""
    block_tables: np.ndarray
    """[B, max_num_blocks] int32, right-padded with 0."""
    logits_indices: np.ndarray
    """[S] int64 token row of the last token of each request that samples."""
    sampling_rows: list[int]
    """[S] batch index of each request that samples, in batch order."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(frozen=True)
class DeviceBatch:
    """The step's inputs on the model's device."""

    input_ids: torch.Tensor
    """[T] int64."""
    positions: torch.Tensor
    """[T] int64."""
    attention: AttentionMetadata
    logits_indices: torch.Tensor
    """[S] int64."""


def prepare_host_batch(
    batch: Sequence[RequestState], num_scheduled_tokens: dict[str, int], block_size: int
) -> HostBatch:
    """numpy inputs for `batch` (states in batch order, num_computed_tokens = start of this step)."""
    num_reqs = len(batch)
    # [4, B]: (query_len, start, known tokens, blocks) per request; plain lists convert fastest.
    per_request = np.array([
        [num_scheduled_tokens[s.request_id] for s in batch], [s.num_computed_tokens for s in batch],
        [len(s.token_ids) for s in batch], [s.block_table.num_blocks for s in batch],
    ], dtype=np.int64).reshape(4, num_reqs)
    query_lens, starts, num_known, num_blocks = per_request
    seq_lens = starts + query_lens
    _check_ranges(batch, per_request, block_size)
    cu_query = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=cu_query[1:])
    request_of_token = np.repeat(np.arange(num_reqs), query_lens)  # [T]
    positions = np.arange(cu_query[-1]) - cu_query[request_of_token] + starts[request_of_token]
    block_tables = _block_tables(batch, num_blocks)
    slots = block_tables[request_of_token, positions // block_size].astype(np.int64) * block_size
    slots += positions % block_size
    input_ids = _gather_input_ids(batch, starts.tolist(), seq_lens.tolist(), int(cu_query[-1]))
    samples = seq_lens == num_known  # [B] the range reaches the end of the known tokens
    return HostBatch(
        input_ids=input_ids, positions=positions, slot_mapping=slots,
        query_start_loc=cu_query.astype(np.int32), seq_lens=seq_lens.astype(np.int32),
        block_tables=block_tables, logits_indices=cu_query[1:][samples] - 1,
        sampling_rows=np.flatnonzero(samples).tolist(),
    )


def _gather_input_ids(batch: Sequence[RequestState], starts: list[int], ends: list[int],
                      num_tokens: int) -> np.ndarray:
    """[T] int64: tokens [start, end) of each request, concatenated in batch order."""
    if num_tokens == len(batch):  # pure decode: one token each, the common case at large batch
        return np.array([s.token_ids[a] for s, a in zip(batch, starts)], dtype=np.int64)
    return np.fromiter((t for s, a, b in zip(batch, starts, ends) for t in s.token_ids[a:b]),
                       dtype=np.int64, count=num_tokens)


def _check_ranges(batch: Sequence[RequestState], per_request: np.ndarray, block_size: int) -> None:
    """The scheduler must never ask for tokens the worker does not know or slots it did not give."""
    query_lens, starts, num_known, num_blocks = per_request
    seq_lens = starts + query_lens
    bad = (query_lens < 1) | (seq_lens > num_known) | (num_blocks * block_size < seq_lens)
    if not bad.any():
        return
    row = int(np.flatnonzero(bad)[0])
    raise ValueError(
        f"request {batch[row].request_id!r}: scheduled {query_lens[row]} tokens from position "
        f"{starts[row]}; it has {num_known[row]} known tokens and {num_blocks[row]} blocks of {block_size}"
    )


def _block_tables(batch: Sequence[RequestState], num_blocks: np.ndarray) -> np.ndarray:
    """[B, max_num_blocks] int32, right-padded with 0, filled by one scatter of all requests' ids."""
    table = np.zeros((len(batch), int(num_blocks.max())), dtype=np.int32)
    all_ids = np.concatenate([s.block_table.ids for s in batch])  # [sum(num_blocks)]
    rows = np.repeat(np.arange(len(batch)), num_blocks)
    first_of_row = np.repeat(np.cumsum(num_blocks) - num_blocks, num_blocks)
    table[rows, np.arange(all_ids.shape[0]) - first_of_row] = all_ids
    return table


class HostStaging:
    """Moves host arrays to the device: zero-copy on CPU; on CUDA via reusable pinned buffers.

    A pinned buffer is rewritten only after the previous step's copies out of it have completed
    (an event recorded behind them): a step of partial prefill chunks never syncs on its own.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned: dict[str, torch.Tensor] = {}
        self._copies_done: torch.cuda.Event | None = None

    def to_device(self, name: str, array: np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type == "cpu":
            return host
        buffer = self._pinned.get(name)
        if buffer is None or buffer.dtype != host.dtype or buffer.numel() < host.numel():
            with torch.inference_mode(False):  # a normal tensor: usable in and outside inference mode
                buffer = torch.empty(max(host.numel(), 2 * (buffer.numel() if buffer is not None else 0)),
                                     dtype=host.dtype, pin_memory=True)
            self._pinned[name] = buffer
        staged = buffer[: host.numel()].view(host.shape)
        staged.copy_(host)
        return staged.to(self.device, non_blocking=True)

    def device_batch(self, host: HostBatch, block_size: int) -> DeviceBatch:
        if self._copies_done is not None:
            self._copies_done.synchronize()
        batch = self._device_batch(host, block_size)
        if self.device.type == "cuda":
            self._copies_done = torch.cuda.Event()
            self._copies_done.record()
        return batch

    def _device_batch(self, host: HostBatch, block_size: int) -> DeviceBatch:
        query_lens = np.diff(host.query_start_loc)
        attention = AttentionMetadata(
            query_start_loc=self.to_device("query_start_loc", host.query_start_loc),
            seq_lens=self.to_device("seq_lens", host.seq_lens),
            block_tables=self.to_device("block_tables", host.block_tables),
            slot_mapping=self.to_device("slot_mapping", host.slot_mapping),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(host.seq_lens.max()),
            query_lens_cpu=query_lens.tolist(),
            seq_lens_cpu=host.seq_lens.tolist(),
            block_size=block_size,
        )
        return DeviceBatch(
            input_ids=self.to_device("input_ids", host.input_ids),
            positions=self.to_device("positions", host.positions),
            attention=attention,
            logits_indices=self.to_device("logits_indices", host.logits_indices),
        )
