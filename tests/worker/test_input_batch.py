"""Host-side input preparation: positions, slots, block tables and which requests sample."""

from __future__ import annotations

import numpy as np
import pytest

from conveyor.sampling_params import SamplingParams
from conveyor.worker.input_batch import prepare_host_batch
from conveyor.worker.request_state import BlockTable, RequestState


def make_state(request_id: str, num_tokens: int, blocks: list[int], num_computed: int) -> RequestState:
    return RequestState(request_id, list(range(100, 100 + num_tokens)), num_tokens, BlockTable(blocks),
                        SamplingParams(), num_computed)


def test_block_table_grows_and_keeps_ids() -> None:
    table = BlockTable([3, 1])
    for block in range(20):
        table.extend([block, block + 100])
    assert table.num_blocks == 42 and table.ids[:4].tolist() == [3, 1, 0, 100]
    assert table.ids[-2:].tolist() == [19, 119]


def test_mixed_batch_layout() -> None:
    # "p": a prefill chunk of 3 tokens at 2..4 of a 7-token prompt; "d": a decode at position 5.
    batch = [make_state("p", 7, [4, 9], 2), make_state("d", 6, [7, 2], 5)]
    host = prepare_host_batch(batch, {"p": 3, "d": 1}, block_size=4)
    assert host.input_ids.tolist() == [102, 103, 104, 105]
    assert host.positions.tolist() == [2, 3, 4, 5]
    assert host.slot_mapping.tolist() == [4 * 4 + 2, 4 * 4 + 3, 9 * 4 + 0, 2 * 4 + 1]
    assert host.query_start_loc.tolist() == [0, 3, 4] and host.seq_lens.tolist() == [5, 6]
    assert host.block_tables.tolist() == [[4, 9], [7, 2]]
    assert host.sampling_rows == [1] and host.logits_indices.tolist() == [3]  # the chunk samples nothing


def test_ragged_block_tables_are_zero_padded() -> None:
    batch = [make_state("a", 2, [5], 1), make_state("b", 9, [1, 2, 3], 8)]
    host = prepare_host_batch(batch, {"a": 1, "b": 1}, block_size=4)
    assert host.block_tables.tolist() == [[5, 0, 0], [1, 2, 3]]
    assert host.sampling_rows == [0, 1] and host.logits_indices.tolist() == [0, 1]
    assert host.block_tables.dtype == np.int32 and host.slot_mapping.dtype == np.int64


def test_missing_blocks_are_reported() -> None:
    with pytest.raises(ValueError, match="1 blocks of 4"):
        prepare_host_batch([make_state("a", 6, [5], 0)], {"a": 6}, block_size=4)
