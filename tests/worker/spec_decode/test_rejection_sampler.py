"""Verification: greedy keeps exactly the drafts the argmax agrees with; sampled verification and the
textbook rejection sampler both reproduce the target distribution (chi-square, fixed seeds)."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from conveyor.sampling_params import SamplingParams
from conveyor.worker.sampler import Sampler
from conveyor.worker.sampling_metadata import SamplingRequest, VocabInfo, build_sampling_batch
from conveyor.worker.spec_decode.rejection_sampler import (
    draft_layout, rejection_sample_ref, verify_drafts, verify_drafts_ref,
)

CPU = torch.device("cpu")
VOCAB = 8
DRAFTS = [3, 5]
LOGITS = torch.tensor([  # the target's logits at the 3 verified positions (after each draft prefix)
    [0.5, 0.1, -1.0, 1.2, 0.0, 0.3, -0.4, 0.8],
    [-0.2, 0.9, 0.4, 0.0, 0.1, 1.1, -1.5, 0.2],
    [1.0, -0.3, 0.2, 0.6, -0.8, 0.0, 0.5, 0.1],
])


def test_greedy_verification_matches_the_reference() -> None:
    rng = random.Random(0)
    for _ in range(50):
        drafts = [[rng.randrange(4) for _ in range(rng.randint(0, 4))] for _ in range(rng.randint(1, 6))]
        targets = [rng.randrange(4) for _ in range(sum(1 + len(d) for d in drafts))]
        verified = verify_drafts(torch.tensor(targets), draft_layout(drafts, CPU))
        assert verified.to_lists() == verify_drafts_ref(targets, drafts)


def test_verification_keeps_the_accepted_prefix_and_one_target_token() -> None:
    drafts = [[7, 8, 9], [], [4, 4]]
    targets = [7, 8, 1, 2, 5, 4, 4, 3]  # request 0 keeps 2 drafts, request 2 all of its drafts
    verified = verify_drafts(torch.tensor(targets), draft_layout(drafts, CPU))
    assert verified.num_accepted.tolist() == [2, 0, 2]
    assert verified.to_lists() == [[7, 8, 1], [5], [4, 4, 3]]


def exact_outcomes(probs: torch.Tensor, drafts: list[int]) -> dict[tuple[int, ...], float]:
    """Probability of every output sequence of sequential sampling, truncated where it leaves the drafts."""
    outcomes: dict[tuple[int, ...], float] = {}
    prefix_prob = 1.0
    for position, draft in enumerate(drafts):
        for token in range(probs.shape[1]):
            if token != draft:
                outcomes[(*drafts[:position], token)] = prefix_prob * probs[position, token].item()
        prefix_prob *= probs[position, draft].item()
    for token in range(probs.shape[1]):
        outcomes[(*drafts, token)] = prefix_prob * probs[len(drafts), token].item()
    return outcomes


def chi_square_ok(observed: Counter, expected: dict[tuple[int, ...], float], num_samples: int) -> bool:
    """Pearson's statistic below the 0.999 quantile (Wilson-Hilferty); impossible outcomes never seen."""
    assert set(observed) <= {o for o, p in expected.items() if p > 0}, set(observed) - set(expected)
    cells = [(observed.get(o, 0), p * num_samples) for o, p in expected.items() if p > 0]
    statistic = sum((seen - want) ** 2 / want for seen, want in cells)
    df = len(cells) - 1
    critical = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3
    return statistic < critical


def target_probs(params: SamplingParams) -> torch.Tensor:
    """What the sampler draws from at each row: temperature, then top-k / top-p."""
    scaled = LOGITS / params.temperature
    if params.top_k is not None:
        kth = scaled.topk(params.top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = scaled.softmax(dim=-1)
    if params.top_p < 1.0:
        ordered, order = probs.sort(dim=-1, descending=True)
        drop = ordered.cumsum(dim=-1) - ordered >= params.top_p
        probs = probs.scatter(1, order, ordered.masked_fill(drop, 0.0))
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.8),
])
def test_sampled_verification_preserves_the_target_distribution(params: SamplingParams) -> None:
    num_requests = 20000
    requests = [SamplingRequest(params, [0] * (1 + position), 1) for _ in range(num_requests) for position in range(3)]
    batch = build_sampling_batch(requests, VocabInfo(VOCAB, frozenset()), CPU)
    sampler = Sampler(torch.Generator().manual_seed(1234))
    targets = sampler.sample(LOGITS.repeat(num_requests, 1), batch)  # [3 N]
    kept = verify_drafts(targets, draft_layout([DRAFTS] * num_requests, CPU)).to_lists()
    assert chi_square_ok(Counter(tuple(k) for k in kept), exact_outcomes(target_probs(params), DRAFTS), num_requests)


def test_seeded_verification_preserves_the_target_distribution_and_repeats() -> None:
    """Requests with seeds 0..N-1 (each position from its own seeded stream): the pooled outputs follow
    the target distribution, and a second run gives every request the same tokens."""
    num_requests = 4000

    def run() -> list[list[int]]:
        requests = [SamplingRequest(SamplingParams(temperature=1.0, seed=seed), [0] * (1 + position), 1,
                                    torch.Generator()) for seed in range(num_requests) for position in range(3)]
        batch = build_sampling_batch(requests, VocabInfo(VOCAB, frozenset()), CPU)
        targets = Sampler(torch.Generator().manual_seed(0)).sample(LOGITS.repeat(num_requests, 1), batch)
        return verify_drafts(targets, draft_layout([DRAFTS] * num_requests, CPU)).to_lists()

    kept = run()
    assert kept == run()
    assert chi_square_ok(Counter(tuple(k) for k in kept), exact_outcomes(LOGITS.softmax(dim=-1), DRAFTS), num_requests)


def test_textbook_rejection_sampler_preserves_the_target_distribution() -> None:
    probs = LOGITS.softmax(dim=-1)
    generator = torch.Generator().manual_seed(99)
    num_samples = 20000
    kept = Counter(tuple(rejection_sample_ref(probs, DRAFTS, generator)) for _ in range(num_samples))
    assert chi_square_ok(kept, exact_outcomes(probs, DRAFTS), num_samples)


def test_a_wrong_distribution_fails_the_check() -> None:
    """The statistical check has teeth: samples of one distribution fail against another."""
    probs = LOGITS.softmax(dim=-1)
    generator = torch.Generator().manual_seed(5)
    kept = Counter(tuple(rejection_sample_ref(probs, DRAFTS, generator)) for _ in range(20000))
    assert not chi_square_ok(kept, exact_outcomes((LOGITS / 1.2).softmax(dim=-1), DRAFTS), 20000)


def test_seeded_rows_draw_the_same_tokens_with_or_without_drafts() -> None:
    """Row i of a seeded request draws from the stream of output position num_output_tokens + i: so
    verification keeps the very tokens plain one-at-a-time sampling draws."""
    params = SamplingParams(temperature=0.9, top_k=6, seed=7)
    shared = torch.Generator().manual_seed(0)

    def draw(position: int) -> int:
        request = SamplingRequest(params, [0] * (1 + position), 1, torch.Generator())
        batch = build_sampling_batch([request], VocabInfo(VOCAB, frozenset()), CPU)
        return int(Sampler(shared).sample(LOGITS[position : position + 1].clone(), batch).item())

    sequential = [draw(position) for position in range(3)]
    for drafts in ([sequential[0], sequential[1]], [sequential[0], (sequential[1] + 1) % VOCAB], [9 % VOCAB, 1]):
        requests = [SamplingRequest(params, [0] * (1 + p), 1, torch.Generator()) for p in range(3)]
        batch = build_sampling_batch(requests, VocabInfo(VOCAB, frozenset()), CPU)
        targets = Sampler(shared).sample(LOGITS.clone(), batch)
        kept = verify_drafts(targets, draft_layout([drafts], CPU)).to_lists()[0]
        num_accepted = 0 if drafts[0] != sequential[0] else 1 if drafts[1] != sequential[1] else 2
        assert kept == sequential[: num_accepted + 1]
