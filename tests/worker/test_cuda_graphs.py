"""CUDA graphs: bucket choice and padded static inputs (CPU), replay == eager forward (GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conveyor.config import CUDAGraphMode
from conveyor.kernels.paged_batch import PagedBatch, paged_attention_ref
from conveyor.model.attention_metadata import AttentionMetadata, SequenceSpec, build_attention_metadata, positions_of
from conveyor.worker.cuda_graphs import GraphPlan, capture_sizes, decode_bucket, mixed_bucket, mixed_capture_sizes
from conveyor.worker.graph_inputs import GraphGeometry, StaticInputs
from conveyor.worker.input_batch import HostBatch

BLOCK = 4


def _host(query_lens: list[int], sampling_rows: list[int] | None = None, width: int = 4) -> HostBatch:
    num_tokens, num_reqs = sum(query_lens), len(query_lens)
    starts = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    return HostBatch(
        input_ids=np.zeros(num_tokens, np.int64), positions=np.zeros(num_tokens, np.int64),
        slot_mapping=np.zeros(num_tokens, np.int64), query_start_loc=starts,
        seq_lens=np.ones(num_reqs, np.int32), block_tables=np.zeros((num_reqs, width), np.int32),
        logits_indices=starts[1:] - 1, sampling_rows=list(range(num_reqs)) if sampling_rows is None else sampling_rows,
    )


def _host_of(metadata: AttentionMetadata, sampling: list[int]) -> HostBatch:
    """The HostBatch a runner would build for `metadata` (token ids = positions, for traceability)."""
    positions = positions_of(metadata).numpy()
    starts = metadata.query_start_loc.numpy()
    return HostBatch(
        input_ids=positions.copy(), positions=positions, slot_mapping=metadata.slot_mapping.numpy(),
        query_start_loc=starts, seq_lens=metadata.seq_lens.numpy(), block_tables=metadata.block_tables.numpy(),
        logits_indices=starts[1:][sampling] - 1, sampling_rows=sampling,
    )


def test_capture_sizes_cover_max_num_seqs() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(300)[:6] == [1, 2, 4, 8, 16, 24] and capture_sizes(300)[-4:] == [256, 272, 288, 300]
    assert capture_sizes(256)[-3:] == [240, 248, 256]
    assert capture_sizes(4096)[-1] == 512


@given(st.integers(1, 9000))
def test_mixed_sizes_pad_little(limit: int) -> None:
    sizes = mixed_capture_sizes(limit)
    assert sizes == sorted(set(sizes)) and sizes[-1] == limit
    for num_tokens in range(1, limit + 1, max(1, limit // 97)):
        bucket = next(s for s in sizes if s >= num_tokens)
        assert bucket - num_tokens < max(128, bucket // 4 + 1)


def test_only_pure_decode_steps_that_all_sample_use_a_decode_graph() -> None:
    sizes = capture_sizes(64)
    assert decode_bucket(_host([1] * 5), sizes, max_blocks_per_seq=4) == 8
    assert decode_bucket(_host([1] * 64), sizes, max_blocks_per_seq=4) == 64
    assert decode_bucket(_host([1, 3]), sizes, max_blocks_per_seq=4) is None  # a prefill chunk
    assert decode_bucket(_host([1, 1], sampling_rows=[0]), sizes, 4) is None  # a 1-token partial chunk
    assert decode_bucket(_host([1] * 65), sizes, max_blocks_per_seq=4) is None  # above the largest bucket
    assert decode_bucket(_host([1], width=5), sizes, max_blocks_per_seq=4) is None


def test_mixed_steps_pick_the_smallest_token_bucket_that_fits() -> None:
    plan = GraphPlan(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=16, block_size=4,
                     mode=CUDAGraphMode.FULL, max_cudagraph_capture_size=256)
    geometry, sizes = plan.geometry(), plan.mixed_sizes()
    assert sizes[-1] == 256 and geometry.max_seqs == 9 and geometry.max_tokens == 256
    assert mixed_bucket(_host([1, 3]), sizes, geometry) == 16
    assert mixed_bucket(_host([1, 1], sampling_rows=[0]), sizes, geometry) == 16
    assert mixed_bucket(_host([100, 100, 50]), sizes, geometry) == 256
    assert mixed_bucket(_host([200, 100]), sizes, geometry) is None  # beyond the largest bucket: eager
    assert mixed_bucket(_host([1] * 9), sizes, geometry) is None  # no row left for the padding sequence
    assert mixed_bucket(_host([5], width=5), sizes, geometry) is None
    decode_only = GraphPlan(8, 512, 16, 4, CUDAGraphMode.FULL_DECODE_ONLY, 256)
    assert decode_only.mixed_sizes() == [] and mixed_bucket(_host([1, 3]), [], decode_only.geometry()) is None


def _random_step(rng: np.random.Generator, num_seqs: int) -> tuple[list[SequenceSpec], list[int]]:
    specs, next_block, sampling = [], 0, []
    for index in range(num_seqs):
        context, query = int(rng.integers(0, 12)), int(rng.integers(1, 7))
        blocks = list(range(next_block, next_block + -(-(context + query) // BLOCK)))
        next_block += len(blocks)
        specs.append(SequenceSpec(query, context + query, blocks))
        if rng.random() < 0.6:
            sampling.append(index)
    return specs, sampling


@pytest.mark.parametrize("seed", range(6))
def test_padded_mixed_step_equals_the_real_step_on_real_rows(seed: int) -> None:
    rng = np.random.default_rng(seed)
    specs, sampling = _random_step(rng, num_seqs=int(rng.integers(1, 6)))
    real = build_attention_metadata(specs, BLOCK, "cpu")
    host = _host_of(real, sampling)
    inputs = StaticInputs(GraphGeometry(max_tokens=64, max_seqs=7, max_blocks_per_seq=5, block_size=BLOCK,
                                        max_model_len=20, max_logits_rows=7), torch.device("cpu"))
    inputs.reset_for_capture()
    inputs.stage(host, 48, mixed=True)
    padded = inputs.mixed_metadata(48)
    num_real = host.num_tokens
    assert padded.slot_mapping[num_real:].eq(-1).all() and padded.slot_mapping[:num_real].tolist() == host.slot_mapping.tolist()
    assert padded.query_start_loc[-1] == 48 and inputs.device_view("input_ids")[:num_real].tolist() == host.input_ids.tolist()
    assert inputs.device_view("logits_indices")[: len(sampling)].tolist() == host.logits_indices.tolist()
    caches = torch.randn(2, 30, BLOCK, 2, 8)
    query = torch.randn(48, 4, 8)
    as_batch = lambda m: PagedBatch(m.block_tables, m.seq_lens, m.query_start_loc, m.max_query_len, m.max_seq_len)  # noqa: E731
    expected = paged_attention_ref(query[:num_real], caches[0], caches[1], as_batch(real), 0.3)
    got = paged_attention_ref(query, caches[0], caches[1], as_batch(padded), 0.3)
    assert torch.equal(got[:num_real], expected) and got[num_real:].eq(0).all()


def test_padded_decode_step_pairs_token_i_with_sequence_i() -> None:
    specs = [SequenceSpec(1, 5, [0, 1]), SequenceSpec(1, 9, [2, 3, 4]), SequenceSpec(1, 1, [5])]
    real = build_attention_metadata(specs, BLOCK, "cpu")
    inputs = StaticInputs(GraphGeometry(16, 9, 5, BLOCK, 20, 9), torch.device("cpu"))
    inputs.stage(_host_of(real, [0, 1, 2]), 8, mixed=False)
    padded = inputs.decode_metadata(8)
    assert padded.seq_lens.tolist() == [5, 9, 1, 0, 0, 0, 0, 0] and padded.slot_mapping[3:].eq(-1).all()
    caches, query = torch.randn(2, 8, BLOCK, 1, 8), torch.randn(8, 2, 8)
    as_batch = lambda m: PagedBatch(m.block_tables, m.seq_lens, m.query_start_loc, m.max_query_len, m.max_seq_len)  # noqa: E731
    got = paged_attention_ref(query, caches[0], caches[1], as_batch(padded), 0.3)
    assert torch.equal(got[:3], paged_attention_ref(query[:3], caches[0], caches[1], as_batch(real), 0.3))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replay_matches_eager_forward() -> None:
    from conveyor.model.attention_triton import TritonAttentionBackend
    from conveyor.worker.cuda_graphs import CudaGraphRunner

    torch.manual_seed(0)
    weight = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
    cache = torch.zeros(2, 32, 16, 2, 16, device="cuda", dtype=torch.bfloat16)
    backend = TritonAttentionBackend()

    def forward(ids, positions, metadata):  # a toy "model": store KV, attend, mix (exercises the kernels)
        x = weight[ids % 64] * (1 + positions[:, None])  # [T, 32]
        q = x.view(-1, 2, 16)
        backend.write_kv(q, q, cache, metadata.slot_mapping)
        return backend.forward(q, cache, metadata, 0.25).reshape(-1, 32)

    plan = GraphPlan(8, 64, 64, 16, CUDAGraphMode.FULL, 64)
    graphs = CudaGraphRunner(forward, plan, torch.device("cuda"))
    graphs.capture()
    for specs, sampling in (
        ([SequenceSpec(1, 5, [0]), SequenceSpec(1, 17, [1, 2]), SequenceSpec(1, 1, [3])], [0, 1, 2]),
        ([SequenceSpec(1, 6, [0]), SequenceSpec(11, 30, [4, 5]), SequenceSpec(7, 7, [6])], [0, 1]),
    ):
        meta = build_attention_metadata(specs, 16, "cuda")
        host = _host_of(AttentionMetadata(**{**meta.__dict__, **{k: getattr(meta, k).cpu() for k in (
            "query_start_loc", "seq_lens", "block_tables", "slot_mapping")}}), sampling)
        replayed = graphs.run(host, lambda ids: None).clone()
        eager = forward(torch.from_numpy(host.input_ids).cuda(), torch.from_numpy(host.positions).cuda(), meta)
        assert torch.equal(replayed, eager[torch.from_numpy(host.logits_indices).cuda()])


def test_verification_steps_fit_mixed_graphs_with_all_their_logits_rows() -> None:
    """A step verifying K drafts per request has 1 + K query tokens and logits rows per request: the
    mixed graphs' token buckets cover it and the static logits_indices hold every row."""
    plan = GraphPlan(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=16, block_size=BLOCK,
                     mode=CUDAGraphMode.FULL, max_cudagraph_capture_size=256, num_speculative_tokens=3)
    geometry = plan.geometry()
    assert geometry.max_logits_rows == 9 * 4
    specs = [SequenceSpec(4, 8, [0, 1]), SequenceSpec(1, 3, [2]), SequenceSpec(3, 12, [3, 4, 5])]
    real = build_attention_metadata(specs, BLOCK, "cpu")
    host = _host_of(real, [0, 1, 2])
    host = HostBatch(**{**host.__dict__, "logits_indices": np.array([0, 1, 2, 3, 4, 5, 6, 7])})  # every token
    size = mixed_bucket(host, plan.mixed_sizes(), geometry)
    assert size == 16 and decode_bucket(host, capture_sizes(8), geometry.max_blocks_per_seq) is None
    inputs = StaticInputs(geometry, torch.device("cpu"))
    inputs.stage(host, size, mixed=True)
    assert inputs.device_view("logits_indices")[:8].tolist() == list(range(8))
    fewer_rows = GraphPlan(8, 512, 16, BLOCK, CUDAGraphMode.FULL, 256, num_speculative_tokens=0).geometry()
    assert fewer_rows.max_logits_rows == 9 and mixed_bucket(host, plan.mixed_sizes(), fewer_rows) == 16
    verify_all = HostBatch(**{**_host([4, 4, 4]).__dict__, "logits_indices": np.arange(12)})  # 3 drafts each
    assert mixed_bucket(verify_all, plan.mixed_sizes(), geometry) == 16
    assert mixed_bucket(verify_all, plan.mixed_sizes(), fewer_rows) is None  # more rows than captured: eager


def test_each_capture_gets_metadata_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a backend derives in the warm-up forward (`backend_plan`) must not leak into the capture: the
    capture computes it again inside the graph, where replays recompute it and its memory is the graph's."""
    import contextlib

    from conveyor.worker.cuda_graphs import CudaGraphRunner

    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 0))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    seen: list[AttentionMetadata] = []

    def forward(ids, positions, metadata):
        assert metadata.backend_plan is None, "a capture saw the warm-up's plan"
        metadata.backend_plan = "derived"
        seen.append(metadata)
        return torch.zeros(ids.shape[0], 4)

    plan = GraphPlan(4, 16, 64, BLOCK, CUDAGraphMode.FULL, 16)
    CudaGraphRunner(forward, plan, torch.device("cpu")).capture()
    assert len(seen) > 2 and len({id(m) for m in seen}) == len(seen)  # `seen` keeps them alive: ids unique
