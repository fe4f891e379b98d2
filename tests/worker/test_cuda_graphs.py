"""Decode CUDA graphs: bucket choice (CPU) and replay == eager forward (GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conveyor.worker.cuda_graphs import capture_sizes, decode_bucket
from conveyor.worker.input_batch import HostBatch


def _host(query_lens: list[int], sampling_rows: list[int] | None = None, width: int = 4) -> HostBatch:
    num_tokens, num_reqs = sum(query_lens), len(query_lens)
    starts = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    return HostBatch(
        input_ids=np.zeros(num_tokens, np.int64), positions=np.zeros(num_tokens, np.int64),
        slot_mapping=np.zeros(num_tokens, np.int64), query_start_loc=starts,
        seq_lens=np.ones(num_reqs, np.int32), block_tables=np.zeros((num_reqs, width), np.int32),
        logits_indices=starts[1:] - 1, sampling_rows=list(range(num_reqs)) if sampling_rows is None else sampling_rows,
    )


def test_capture_sizes_cover_max_num_seqs() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(256)[-3:] == [224, 240, 256]
    assert capture_sizes(4096)[-1] == 512


def test_only_pure_decode_steps_that_all_sample_use_a_graph() -> None:
    sizes = capture_sizes(64)
    assert decode_bucket(_host([1] * 5), sizes, max_blocks_per_seq=4) == 8
    assert decode_bucket(_host([1] * 64), sizes, max_blocks_per_seq=4) == 64
    assert decode_bucket(_host([1, 3]), sizes, max_blocks_per_seq=4) is None  # a prefill chunk
    assert decode_bucket(_host([1, 1], sampling_rows=[0]), sizes, 4) is None  # a 1-token partial chunk
    assert decode_bucket(_host([1] * 65), sizes, max_blocks_per_seq=4) is None  # above the largest bucket
    assert decode_bucket(_host([1], width=5), sizes, max_blocks_per_seq=4) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replay_matches_eager_forward() -> None:
    from conveyor.model.attention_metadata import SequenceSpec, build_attention_metadata, positions_of
    from conveyor.worker.cuda_graphs import CudaGraphRunner, GraphGeometry

    torch.manual_seed(0)
    weight = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
    cache = torch.zeros(2, 16, 16, 2, 16, device="cuda", dtype=torch.bfloat16)

    def forward(ids, positions, metadata):  # a toy "model": store KV, attend, mix (exercises the kernels)
        from conveyor.model.attention_triton import TritonAttentionBackend

        backend = TritonAttentionBackend()
        x = weight[ids % 64] * (1 + positions[:, None])  # [B, 32]
        q = x.view(-1, 2, 16)
        backend.write_kv(q, q, cache, metadata.slot_mapping)
        return backend.forward(q, cache, metadata, 0.25).reshape(-1, 32)

    graphs = CudaGraphRunner(forward, GraphGeometry(8, 4, 16, 64), torch.device("cuda"))
    graphs.capture()
    seqs = [SequenceSpec(1, 5, [0]), SequenceSpec(1, 17, [1, 2]), SequenceSpec(1, 1, [3])]
    meta = build_attention_metadata(seqs, 16, "cuda")
    ids = torch.tensor([3, 9, 27], device="cuda")
    positions = positions_of(meta).cuda()
    host = HostBatch(
        input_ids=ids.cpu().numpy(), positions=positions.cpu().numpy(), slot_mapping=meta.slot_mapping.cpu().numpy(),
        query_start_loc=meta.query_start_loc.cpu().numpy(), seq_lens=meta.seq_lens.cpu().numpy(),
        block_tables=meta.block_tables.cpu().numpy(), logits_indices=np.arange(3), sampling_rows=[0, 1, 2],
    )
    replayed = graphs.run(host).clone()
    eager = forward(ids, positions, meta)
    assert torch.equal(replayed, eager)
