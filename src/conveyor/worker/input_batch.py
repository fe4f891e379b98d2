"""One step's model inputs for the whole mixed batch, built on the host in one go, then moved once.

Request `i` of the batch computes `query_lens[i]` tokens starting at position `num_computed[i]`:
its tokens `token_ids[start:start + n]`, positions `start .. start + n - 1`, and cache slots
`block_ids[pos // block_size] * block_size + pos % block_size`. The flat token axis concatenates
requests in batch order (vLLM's varlen layout; no padding). A request samples iff its range reaches
the end of its known tokens; its logits row is the hidden state of its last token. Under speculative
decoding a request's draft tokens follow its known tokens as the last of its scheduled tokens, and it
also gets a logits row at each draft (1 + K rows: the target's token after each prefix).

Everything is computed with numpy over the whole batch, then each field becomes ONE tensor and, on
CUDA, ONE host→device copy through a pinned staging buffer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import torch

from conveyor.model.attention_metadata import AttentionMetadata
from conveyor.worker.request_state import BlockTable, RequestState


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
    """[N] int64 token rows that go through the LM head: the last token of each request that samples
    (N = S), preceded by its draft positions under speculative decoding (N = S + drafts)."""
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
    """[N] int64."""


NO_DRAFTS: Mapping[str, list[int]] = MappingProxyType({})
"""`prepare_host_batch`'s default: a step without speculative decoding."""


def prepare_host_batch(
    batch: Sequence[RequestState], num_scheduled_tokens: Mapping[str, int], block_size: int,
    spec_tokens: Mapping[str, list[int]] = NO_DRAFTS,
) -> HostBatch:
    """numpy inputs for `batch` (states in batch order, num_computed_tokens = start of this step).

    `spec_tokens[request_id]`: draft tokens the request verifies; they are the last of its scheduled
    tokens, follow its known tokens, and it gets a logits row at each of them as well."""
    num_reqs = len(batch)
    num_drafts = [len(spec_tokens.get(s.request_id, ())) for s in batch] if spec_tokens else [0] * num_reqs
    # [5, B]: (query_len, start, known tokens, blocks, drafts) per request; plain lists convert fastest.
    per_request = np.array([
        [num_scheduled_tokens[s.request_id] for s in batch], [s.num_computed_tokens for s in batch],
        [len(s.token_ids) for s in batch], [s.block_table.num_blocks for s in batch], num_drafts,
    ], dtype=np.int64).reshape(5, num_reqs)
    query_lens, starts, num_known, _num_blocks, drafts = per_request
    num_known = num_known + drafts
    _check_ranges(batch, per_request, block_size)
    layout = layout_batch(starts, query_lens, [s.block_table for s in batch], block_size)
    samples = layout.seq_lens == num_known  # [B] the range reaches the end of the known tokens
    if spec_tokens:
        _check_drafts_sample(batch, drafts, samples)
    input_ids = _gather_input_ids(batch, starts.tolist(), layout.seq_lens.tolist(), layout.num_tokens, spec_tokens)
    return host_batch(layout, input_ids, _logits_indices(layout, samples, drafts), np.flatnonzero(samples).tolist())


def host_batch(layout: BatchLayout, input_ids: np.ndarray, logits_indices: np.ndarray,
               sampling_rows: list[int]) -> HostBatch:
    """The HostBatch of a layout, its [T] input ids and the rows that go through the LM head."""
    return HostBatch(
        input_ids=input_ids, positions=layout.positions, slot_mapping=layout.slot_mapping,
        query_start_loc=layout.query_start_loc.astype(np.int32), seq_lens=layout.seq_lens.astype(np.int32),
        block_tables=layout.block_tables, logits_indices=logits_indices, sampling_rows=sampling_rows,
    )


@dataclass(frozen=True)
class BatchLayout:
    """Where each request's tokens of a step go: the part of the inputs that needs no token ids."""

    query_start_loc: np.ndarray
    """[B + 1] int64 cumulative query lengths."""
    positions: np.ndarray
    """[T] int64."""
    slot_mapping: np.ndarray
    """[T] int64."""
    seq_lens: np.ndarray
    """[B] int64 context length after the step."""
    block_tables: np.ndarray
    """[B, max_num_blocks] int32, right-padded with 0."""

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])


def layout_batch(starts: np.ndarray, query_lens: np.ndarray, tables: Sequence[BlockTable],
                 block_size: int) -> BatchLayout:
    """Request i computes positions starts[i] .. starts[i] + query_lens[i] - 1 into its blocks `tables[i]`."""
    num_reqs = len(tables)
    cu_query = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=cu_query[1:])
    request_of_token = np.repeat(np.arange(num_reqs), query_lens)  # [T]
    positions = np.arange(cu_query[-1]) - cu_query[request_of_token] + starts[request_of_token]
    block_tables = _block_tables(tables)
    slots = block_tables[request_of_token, positions // block_size].astype(np.int64) * block_size
    slots += positions % block_size
    return BatchLayout(query_start_loc=cu_query, positions=positions, slot_mapping=slots,
                       seq_lens=starts + query_lens, block_tables=block_tables)


def _logits_indices(layout: BatchLayout, samples: np.ndarray, drafts: np.ndarray) -> np.ndarray:
    """[N] token rows that go through the LM head: each sampling request's last token, preceded by
    its draft positions (its last 1 + num_drafts rows) under speculative decoding."""
    ends = layout.query_start_loc[1:][samples]
    if not drafts.any():
        return ends - 1
    num_rows = 1 + drafts[samples]  # [S]
    first_of_request = np.repeat(np.cumsum(num_rows) - num_rows, num_rows)
    return np.repeat(ends - num_rows, num_rows) + np.arange(int(num_rows.sum())) - first_of_request


def _gather_input_ids(batch: Sequence[RequestState], starts: list[int], ends: list[int],
                      num_tokens: int, spec_tokens: Mapping[str, list[int]]) -> np.ndarray:
    """[T] int64: tokens [start, end) of each request (its drafts after its known tokens), in batch order."""
    if num_tokens == len(batch):  # pure decode: one token each, the common case at large batch
        return np.array([s.token_ids[a] for s, a in zip(batch, starts)], dtype=np.int64)
    if spec_tokens:
        return np.fromiter((t for s, a, b in zip(batch, starts, ends)
                            for t in _with_drafts(s.token_ids, spec_tokens.get(s.request_id), a, b)),
                           dtype=np.int64, count=num_tokens)
    return np.fromiter((t for s, a, b in zip(batch, starts, ends) for t in s.token_ids[a:b]),
                       dtype=np.int64, count=num_tokens)


def _with_drafts(token_ids: list[int], drafts: list[int] | None, start: int, end: int) -> list[int]:
    return token_ids[start:end] if not drafts else token_ids[start:] + drafts


def _check_ranges(batch: Sequence[RequestState], per_request: np.ndarray, block_size: int) -> None:
    """The scheduler must never ask for tokens the worker does not know or slots it did not give."""
    query_lens, starts, num_known, num_blocks, drafts = per_request
    seq_lens = starts + query_lens
    bad = (query_lens < 1) | (seq_lens > num_known + drafts) | (num_blocks * block_size < seq_lens)
    if not bad.any():
        return
    row = int(np.flatnonzero(bad)[0])
    raise ValueError(
        f"request {batch[row].request_id!r}: scheduled {query_lens[row]} tokens from position "
        f"{starts[row]}; it has {num_known[row]} known tokens, {drafts[row]} drafts and "
        f"{num_blocks[row]} blocks of {block_size}"
    )


def _check_drafts_sample(batch: Sequence[RequestState], drafts: np.ndarray, samples: np.ndarray) -> None:
    """Drafts are the last scheduled tokens: a request verifying drafts must reach them (and so sample)."""
    bad = (drafts > 0) & ~samples
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise ValueError(f"request {batch[row].request_id!r}: {drafts[row]} draft tokens scheduled, but its "
                         "scheduled range ends before them (drafts must be the last scheduled tokens)")


def _block_tables(tables: Sequence[BlockTable]) -> np.ndarray:
    """[B, max_num_blocks] int32, right-padded with 0, filled by one scatter of all requests' ids."""
    num_blocks = np.array([t.num_blocks for t in tables], dtype=np.int64)
    table = np.zeros((len(tables), int(num_blocks.max())), dtype=np.int32)
    all_ids = np.concatenate([t.ids for t in tables])  # [sum(num_blocks)]
    rows = np.repeat(np.arange(len(tables)), num_blocks)
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
