"""Static inputs of the captured CUDA graphs: one pinned host buffer, one device buffer, one copy per step.

A graph reads fixed addresses, so every input lives in a view of ONE device byte buffer laid out as
`input_ids | positions | slot_mapping (int64, max_tokens each) | seq_lens (int32, max_seqs) |
query_start_loc (int32, max_seqs + 1) | logits_indices (int64, max_logits_rows) | block_tables (int32,
max_seqs x max_blocks)`; the host writes the same layout into a pinned buffer and each step makes ONE
host-to-device copy of the prefix it used (block tables last, so only the rows in use travel).

Padding keeps a padded step equal to the real one on its real rows and lets it touch nothing else:
padding tokens get slot -1 (store_kv skips them) and position 0; padding sequences get seq_len 0
(attention writes zeros and reads no block table). A *decode* graph of B rows pairs token i with
sequence i (`query_start_loc` is the constant arange). A *mixed* graph of T tokens always has
`max_seqs` sequences: the real ones, then one padding sequence owning the padding tokens [n, T), then
empty sequences (`query_start_loc` = T) -- so its kernel grid, which depends only on T and the number
of sequences, is the same at capture and at every replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from conveyor.model.attention_metadata import AttentionMetadata
from conveyor.worker.input_batch import HostBatch


@dataclass(frozen=True)
class GraphGeometry:
    """What fixes the static buffers' layout."""

    max_tokens: int
    """Rows of the token fields: the largest captured bucket of either kind."""
    max_seqs: int
    """Rows of the sequence fields: max_num_seqs + 1 (room for a mixed step's padding sequence)."""
    max_blocks_per_seq: int
    """Block-table width: ceil(max_model_len / block_size)."""
    block_size: int
    max_model_len: int
    max_logits_rows: int
    """Rows of logits_indices: one per sequence, 1 + K per sequence under speculative decoding."""


_FIELDS: tuple[tuple[str, type, str], ...] = (
    ("input_ids", np.int64, "max_tokens"), ("positions", np.int64, "max_tokens"),
    ("slot_mapping", np.int64, "max_tokens"), ("seq_lens", np.int32, "max_seqs"),
    ("query_start_loc", np.int32, "max_seqs+1"), ("logits_indices", np.int64, "max_logits_rows"),
)
"""(name, dtype, rows) of every field before block_tables, in buffer order."""


class StaticInputs:
    """The pinned host buffer and the device buffer with the same layout, and typed views of both."""

    def __init__(self, geometry: GraphGeometry, device: torch.device) -> None:
        self.geometry = geometry
        self.offsets: dict[str, int] = {}
        self.rows: dict[str, int] = {}
        offset = 0
        for name, dtype, rows in _FIELDS:
            count = {"max_tokens": geometry.max_tokens, "max_seqs": geometry.max_seqs,
                     "max_seqs+1": geometry.max_seqs + 1, "max_logits_rows": geometry.max_logits_rows}[rows]
            self.offsets[name], self.rows[name] = offset, count
            offset += -(-count * np.dtype(dtype).itemsize // 16) * 16  # 16-byte aligned fields
        self.offsets["block_tables"] = offset
        self.num_bytes = offset + geometry.max_seqs * geometry.max_blocks_per_seq * 4
        on_cuda = device.type == "cuda"  # the CPU build serves the padding tests: same layout, no copy fence
        self.host = torch.zeros(self.num_bytes, dtype=torch.uint8, pin_memory=on_cuda)
        self.device_bytes = torch.zeros(self.num_bytes, dtype=torch.uint8, device=device)
        self.copy_done = torch.cuda.Event() if on_cuda else None
        self.decode_query_start_loc = torch.arange(geometry.max_tokens + 1, dtype=torch.int32, device=device)

    def device_view(self, name: str) -> torch.Tensor:
        return self._view(self.device_bytes, name)

    def host_view(self, name: str) -> np.ndarray:
        return self._view(self.host, name).numpy()

    def _view(self, buffer: torch.Tensor, name: str) -> torch.Tensor:
        start = self.offsets[name]
        if name == "block_tables":
            rows, width = self.geometry.max_seqs, self.geometry.max_blocks_per_seq
            return buffer[start : start + rows * width * 4].view(torch.int32).view(rows, width)
        dtype = next(d for n, d, _ in _FIELDS if n == name)
        torch_dtype = torch.int64 if dtype is np.int64 else torch.int32
        return buffer[start : start + self.rows[name] * np.dtype(dtype).itemsize].view(torch_dtype)

    def reset_for_capture(self) -> None:
        """Contents that make a capture-time forward write no KV and read no block table."""
        self.device_view("slot_mapping").fill_(-1)
        self.device_view("seq_lens").zero_()
        self.device_view("query_start_loc").zero_()
        self.device_view("logits_indices").zero_()

    def stage(self, host: HostBatch, num_tokens: int, mixed: bool) -> None:
        """Write the step padded to num_tokens (a decode or mixed graph's bucket), then ONE device copy."""
        if self.copy_done is not None:
            self.copy_done.synchronize()  # the previous step's copy has left the pinned buffer
        num_real, num_reqs = host.num_tokens, host.seq_lens.shape[0]
        num_seqs = self.geometry.max_seqs if mixed else num_tokens
        for name, pad in (("input_ids", 0), ("positions", 0), ("slot_mapping", -1)):
            view = self.host_view(name)
            view[:num_real] = getattr(host, name)
            view[num_real:num_tokens] = pad
        seq_lens = self.host_view("seq_lens")
        seq_lens[:num_reqs] = host.seq_lens
        seq_lens[num_reqs:num_seqs] = 0
        if mixed:
            starts = self.host_view("query_start_loc")
            starts[: num_reqs + 1] = host.query_start_loc
            starts[num_reqs + 1 : num_seqs + 1] = num_tokens  # padding sequence, then empty ones
            self.host_view("logits_indices")[: len(host.logits_indices)] = host.logits_indices
        width = host.block_tables.shape[1]
        self.host_view("block_tables")[:num_reqs, :width] = host.block_tables
        used = self.offsets["block_tables"] + num_reqs * self.geometry.max_blocks_per_seq * 4
        self.device_bytes[:used].copy_(self.host[:used], non_blocking=True)
        if self.copy_done is not None:
            self.copy_done.record()

    def decode_metadata(self, batch_size: int) -> AttentionMetadata:
        """batch_size one-token sequences; host fields describe the capture (worst case) shape."""
        return self._metadata(self.decode_query_start_loc[: batch_size + 1], batch_size, batch_size, 1)

    def mixed_metadata(self, num_tokens: int) -> AttentionMetadata:
        """num_tokens query tokens over max_seqs sequences (see the module docstring)."""
        starts = self.device_view("query_start_loc")
        return self._metadata(starts, num_tokens, self.geometry.max_seqs, num_tokens)

    def _metadata(self, starts: torch.Tensor, num_tokens: int, num_seqs: int,
                  max_query_len: int) -> AttentionMetadata:
        geometry = self.geometry
        # The *_cpu lists only size host loops of the torch backend, which graphs never run; here they
        # describe the capture shape: all query tokens in the first sequence, every context maximal.
        return AttentionMetadata(
            query_start_loc=starts,
            seq_lens=self.device_view("seq_lens")[:num_seqs],
            block_tables=self.device_view("block_tables")[:num_seqs],
            slot_mapping=self.device_view("slot_mapping")[:num_tokens],
            max_query_len=max_query_len,
            max_seq_len=geometry.max_model_len,
            query_lens_cpu=[max_query_len] + [1 if max_query_len == 1 else 0] * (num_seqs - 1),
            seq_lens_cpu=[geometry.max_model_len] * num_seqs,
            block_size=geometry.block_size,
        )
