"""Sampler features on hand-made logits."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from conveyor.sampling_params import SamplingParams
from conveyor.worker.sampler import (
    Sampler,
    SamplingPath,
    apply_penalties,
    reads_lm_head_logits,
    sampling_path,
)
from conveyor.worker.sampler_staged import top_k_top_p_candidates
from conveyor.worker.sampling_metadata import (
    GrammarMask,
    SamplingRequest,
    VocabInfo,
    build_sampling_batch,
)

VOCAB = VocabInfo(vocab_size=8, eos_token_ids=frozenset({7}))
CPU = torch.device("cpu")


def make_request(prompt: list[int] | None = None, output: list[int] | None = None,
                 **params: object) -> SamplingRequest:
    prompt = [0] if prompt is None else prompt
    output = [] if output is None else output
    sampling_params = SamplingParams(**params)  # type: ignore[arg-type]
    generator = torch.Generator() if sampling_params.seed is not None else None
    return SamplingRequest(sampling_params, prompt + output, len(prompt), generator)


def sample(logits: torch.Tensor, requests: list[SamplingRequest], seed: int = 0) -> list[int]:
    batch = build_sampling_batch(requests, VOCAB, CPU)
    return Sampler(torch.Generator().manual_seed(seed))(logits.clone(), batch).sampled_token_ids


def test_all_greedy_batch_is_argmax_and_builds_nothing_else() -> None:
    logits = torch.randn(4, 8)
    requests = [make_request(temperature=0.0) for _ in range(4)]
    batch = build_sampling_batch(requests, VOCAB, CPU)
    assert batch.all_greedy and batch.random is None and batch.penalties is None
    assert batch.masked_rows is None and batch.max_num_logprobs is None
    assert sample(logits, requests) == logits.argmax(-1).tolist()


def test_mixed_batch_keeps_greedy_rows_exact_and_processes_only_random_rows() -> None:
    logits = torch.randn(6, 8)
    requests = [make_request(temperature=0.0 if i % 2 else 1.5, top_k=None if i % 2 else 1) for i in range(6)]
    batch = build_sampling_batch(requests, VOCAB, CPU)
    assert batch.random is not None and batch.random.rows is not None
    assert batch.random.rows.tolist() == [0, 2, 4] and batch.random.temperature.tolist() == [1.5] * 3
    assert sample(logits, requests) == logits.argmax(-1).tolist()  # top_k=1 draws the argmax too


def test_all_random_batch_needs_no_gather() -> None:
    batch = build_sampling_batch([make_request(temperature=1.0), make_request(temperature=0.5)], VOCAB, CPU)
    assert batch.random is not None and batch.random.rows is None
    assert batch.random.top_k is None and batch.random.top_p is None and batch.random.min_p is None


def test_temperature_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 0, 0, 0, 0, 0]]).clamp_min(1e-12))
    requests = [make_request(temperature=1.0)] * 4000
    tokens = sample(logits.expand(4000, 8), requests)
    counts = torch.bincount(torch.tensor(tokens), minlength=8).float() / 4000
    assert torch.allclose(counts[:3], torch.tensor([0.5, 0.3, 0.2]), atol=0.04)
    assert counts[3:].sum() == 0


def test_top_k_keeps_only_k_best() -> None:
    logits = torch.arange(8.0).expand(500, 8)
    tokens = sample(logits, [make_request(temperature=1.0, top_k=2)] * 500)
    assert set(tokens) == {6, 7}


def kept_tokens(logits: torch.Tensor, top_k: list[int] | None, top_p: list[float] | None) -> list[set[int]]:
    k = torch.tensor(top_k) if top_k is not None else None
    p = torch.tensor(top_p) if top_p is not None else None
    values, ids = top_k_top_p_candidates(logits, k, p, max(top_k) if top_k else logits.shape[1])
    return [set(ids[row][values[row].isfinite()].tolist()) for row in range(logits.shape[0])]


def test_top_p_keeps_smallest_prefix_reaching_p() -> None:
    probs = torch.tensor([0.1, 0.3, 0.2, 0.4, 0, 0, 0, 0]).clamp_min(1e-12)
    logits = torch.log(probs).expand(3, 8)
    # 0.4 + 0.3 reaches 0.7; the best token always stays
    assert kept_tokens(logits, None, [0.65, 0.7, 0.05]) == [{3, 1}, {3, 1}, {3}]


def test_top_k_and_top_p_together() -> None:
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1, 0, 0, 0, 0]).clamp_min(1e-12)
    logits = torch.log(probs).expand(2, 8)
    # row 0: top-k leaves 0.4/0.3/0.2 (renormalised 0.44/0.33/0.22); 0.44 + 0.33 reaches 0.75.
    assert kept_tokens(logits, [3, 2], [0.75, 1.0]) == [{0, 1}, {0, 1}]


def test_seeded_draw_does_not_depend_on_other_rows_top_k() -> None:
    logits = torch.randn(2, 8)
    seeded = make_request(temperature=1.0, top_k=6, seed=5)
    for other in (make_request(temperature=1.0, top_k=2), make_request(temperature=1.0)):
        alone = sample(logits[:1], [seeded])
        assert sample(logits, [seeded, other])[0] == alone[0]


def test_min_p_drops_unlikely_tokens() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0, 0, 0, 0]).clamp_min(1e-12)
    logits = torch.log(probs).expand(2000, 8)
    tokens = sample(logits, [make_request(temperature=1.0, min_p=0.4)] * 2000)
    assert set(tokens) == {0, 1}  # 0.15 < 0.4 * 0.5


def test_seeded_rows_reproduce_regardless_of_batch() -> None:
    logits = torch.randn(5, 8)
    alone = sample(logits[2:3], [make_request(temperature=1.0, seed=42)], seed=1)
    others = [make_request(temperature=1.0) for _ in range(5)]
    others[2] = make_request(temperature=1.0, seed=42)
    batched = sample(logits, others, seed=7)
    assert batched[2] == alone[0]
    draws = {tuple(sample(logits, [make_request(temperature=1.0, seed=s) for _ in range(5)]))
             for s in range(8)}
    assert len(draws) > 1  # different seeds do differ


def test_seeded_stream_depends_on_output_position() -> None:
    logits = torch.zeros(1, 8)
    draws = [sample(logits, [make_request(output=[1] * n, temperature=1.0, seed=3)])[0] for n in range(20)]
    assert len(set(draws)) > 1
    again = [sample(logits, [make_request(output=[1] * n, temperature=1.0, seed=3)])[0] for n in range(20)]
    assert draws == again


def test_repetition_penalty_hf_semantics() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 0, 0, 0, 0]])
    request = make_request(prompt=[0], output=[1], temperature=0.0, repetition_penalty=2.0)
    batch = build_sampling_batch([request], VOCAB, CPU)
    assert batch.penalties is not None
    apply_penalties(logits, batch.penalties)
    assert logits[0, :4].tolist() == [1.0, -4.0, 1.0, 0.5]  # prompt token divided, output token multiplied


def test_frequency_and_presence_penalties_openai_semantics() -> None:
    logits = torch.zeros(1, 8)
    request = make_request(prompt=[5], output=[1, 1, 2], temperature=0.0,
                           frequency_penalty=0.5, presence_penalty=0.25)
    batch = build_sampling_batch([request], VOCAB, CPU)
    assert batch.penalties is not None
    apply_penalties(logits, batch.penalties)
    assert logits[0].tolist() == [0, -1.25, -0.75, 0, 0, 0, 0, 0]  # prompt token 5 untouched


def test_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.5, 0, 0, 0, 0, 0, 0]])
    assert sample(logits, [make_request(output=[0], temperature=0.0)]) == [0]
    assert sample(logits, [make_request(output=[0], temperature=0.0, presence_penalty=1.0)]) == [1]


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.tensor([[0, 0, 0, 5.0, 0, 0, 0, 9.0]])
    blocked = make_request(output=[1], temperature=0.0, min_tokens=3, stop_token_ids=(3,))
    assert sample(logits, [blocked]) not in ([7], [3])
    reached = make_request(output=[1, 1, 1], temperature=0.0, min_tokens=3, stop_token_ids=(3,))
    assert sample(logits, [reached]) == [7]


def test_min_tokens_masks_eos_even_with_ignore_eos() -> None:
    # vLLM 0.24 adds every EOS id to `_all_stop_token_ids` whatever ignore_eos says
    # (`update_from_generation_config`), and its min_tokens processor masks that set: ignore_eos only stops
    # EOS from ending the request, it does not let min_tokens' outputs be EOS.
    logits = torch.tensor([[0, 0, 0, 5.0, 0, 0, 0, 9.0]])
    request = make_request(temperature=0.0, min_tokens=3, ignore_eos=True, stop_token_ids=(3,))
    assert sample(logits, [request]) not in ([7], [3])
    reached = make_request(output=[1, 1, 1], temperature=0.0, min_tokens=3, ignore_eos=True)
    assert sample(logits, [reached]) == [7]


def test_logprobs_are_raw_with_rank_and_top() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 4.0]])
    requests = [make_request(temperature=0.0, logprobs=2, presence_penalty=2.0, output=[1]),
                make_request(temperature=0.0)]
    batch = build_sampling_batch(requests, VOCAB, CPU)
    out = Sampler(torch.Generator())(logits.clone(), batch)
    assert out.sampled_token_ids[0] == 2  # the penalty moved the choice from 1 to 2
    raw = torch.log_softmax(logits[0], -1)
    first = out.logprobs[0]
    assert first is not None and out.logprobs[1] is None
    assert first.token_id == 2 and first.rank == 2
    assert math.isclose(first.logprob, raw[2].item(), rel_tol=1e-6)
    assert first.top_token_ids == [1, 2]
    assert first.top_logprobs == pytest.approx(raw[[1, 2]].tolist())


def test_logprobs_zero_gives_only_the_sampled_token() -> None:
    out = Sampler(torch.Generator())(torch.randn(1, 8), build_sampling_batch(
        [make_request(temperature=0.0, logprobs=0)], VOCAB, CPU))
    entry = out.logprobs[0]
    assert entry is not None and entry.rank == 1 and entry.top_token_ids == []


def dispatch(*requests: SamplingRequest, fused_available: bool = True) -> tuple[SamplingPath, bool]:
    """(path, reads the LM head's dtype) of a batch of `requests` plus one greedy row."""
    batch = build_sampling_batch([*requests, make_request(temperature=0.0)], VOCAB, CPU)
    return sampling_path(batch, fused_available), reads_lm_head_logits(batch, fused_available)


def test_fused_path_only_for_plain_temperature_rows_on_the_shared_generator() -> None:
    assert dispatch(make_request(temperature=0.8)) == (SamplingPath.FUSED, True)
    assert dispatch(make_request(temperature=0.8, logprobs=3)) == (SamplingPath.FUSED, True)  # float32 apart
    assert dispatch(make_request(temperature=0.0)) == (SamplingPath.GREEDY, True)
    for staged in ({"top_k": 5}, {"top_p": 0.9}, {"min_p": 0.1}, {"seed": 1}):
        # the staged path reads the LM head's dtype too, one row chunk at a time (no float32 copy)
        assert dispatch(make_request(temperature=0.8, **staged)) == (SamplingPath.STAGED, True), staged
        # one such row sends the whole batch down the staged path (seeded rows reproduce as before)
        pair = (make_request(temperature=0.8), make_request(temperature=1.2, **staged))
        assert dispatch(*pair) == (SamplingPath.STAGED, True), staged
        edited = make_request(temperature=0.8, presence_penalty=0.5, **staged)
        assert dispatch(edited) == (SamplingPath.STAGED, False), staged  # edits write float32 logits


def test_edits_keep_the_fused_draw_but_make_a_float32_copy() -> None:
    edits: list[dict[str, object]] = [{"presence_penalty": 0.5}, {"repetition_penalty": 1.2},
                                      {"logit_bias": ((3, 1.0),)}, {"min_tokens": 2}]
    for edit in edits:
        assert dispatch(make_request(temperature=0.8, **edit)) == (SamplingPath.FUSED, False), edit
        assert dispatch(make_request(temperature=0.0, **edit)) == (SamplingPath.GREEDY, False), edit
    batch = build_sampling_batch([make_request(temperature=0.8)], VOCAB, CPU)
    grammar = GrammarMask(torch.tensor([0]), torch.full((1, 1), -1, dtype=torch.int32))
    assert not reads_lm_head_logits(dataclasses.replace(batch, grammar=grammar), True)
    assert reads_lm_head_logits(batch, True)


def test_without_the_kernel_nothing_is_fused_or_read_as_bf16() -> None:
    assert dispatch(make_request(temperature=0.8), fused_available=False) == (SamplingPath.STAGED, False)
    assert dispatch(make_request(temperature=0.0), fused_available=False) == (SamplingPath.GREEDY, False)


def test_cpu_sampler_takes_bf16_logits_as_their_float32_values() -> None:
    logits = torch.randn(6, 8).bfloat16()
    requests = [make_request(temperature=0.0), make_request(temperature=0.9, seed=4), make_request(temperature=1.3)]
    assert sample(logits[:3], requests, seed=2) == sample(logits[:3].float(), requests, seed=2)
    out = Sampler(torch.Generator())(logits.clone(), build_sampling_batch(
        [make_request(temperature=0.0, logprobs=1)] * 6, VOCAB, CPU))
    assert out.sampled_token_ids == logits.float().argmax(-1).tolist()
    first = out.logprobs[0]
    assert first is not None and first.logprob == pytest.approx(
        torch.log_softmax(logits[0].float(), -1)[first.token_id].item(), abs=1e-6)
