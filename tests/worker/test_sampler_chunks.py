"""The chunked sampler draws the same tokens, with the same logprobs, as one whole-batch pass."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from conveyor.sampling_params import SamplingParams
from conveyor.worker.sampler import Sampler, SamplerOutput
from conveyor.worker.sampler_staged import (
    SAMPLER_CHUNK_BYTES,
    STAGED_BYTES_PER_LOGIT,
    row_chunks,
    rows_per_chunk,
)
from conveyor.worker.sampling_metadata import (
    GrammarMask,
    SamplingRequest,
    VocabInfo,
    build_sampling_batch,
)
from conveyor.worker.warmup import profile_sampling_requests

VOCAB_SIZE = 96
VOCAB = VocabInfo(vocab_size=VOCAB_SIZE, eos_token_ids=frozenset({5}))
CPU = torch.device("cpu")
NUM_ROWS = 23
CHUNK_ROWS = (1, 3, 7, NUM_ROWS - 1)
"""Rows per chunk forced by a tiny byte budget; None (one whole-batch pass) is the reference."""


def chunk_bytes(rows: int) -> int:
    """The budget that makes chunks of `rows` rows at VOCAB_SIZE."""
    return rows * VOCAB_SIZE * STAGED_BYTES_PER_LOGIT


def run(make_params: Callable[[int], SamplingParams], budget: int | None, logits: torch.Tensor,
        grammar: bool = False) -> SamplerOutput:
    """One sampler call on fresh requests (their generators are consumed by a draw) from a fixed seed."""
    requests = []
    for row in range(NUM_ROWS):
        params = make_params(row)
        generator = torch.Generator() if params.seed is not None else None
        history = [row % VOCAB_SIZE, (3 * row) % VOCAB_SIZE, 5]
        requests.append(SamplingRequest(params, history + [row % 4] * (row % 3), len(history), generator))
    batch = build_sampling_batch(requests, VOCAB, CPU)
    if grammar:
        rows = torch.arange(0, NUM_ROWS, 2)  # [G]
        words = torch.randint(-(1 << 31), 1 << 31, (rows.shape[0], -(-VOCAB_SIZE // 32)),
                              generator=torch.Generator().manual_seed(3), dtype=torch.int64).to(torch.int32)
        batch = dataclasses.replace(batch, grammar=GrammarMask(rows, words))
    return Sampler(torch.Generator().manual_seed(11), chunk_bytes=budget)(logits.clone(), batch)


CASES: dict[str, Callable[[int], SamplingParams]] = {
    "greedy": lambda row: SamplingParams(temperature=0.0),
    "temperature": lambda row: SamplingParams(temperature=0.5 + row / 20),
    "mixed greedy and random": lambda row: SamplingParams(temperature=(row % 3) * 0.6),
    "top_k": lambda row: SamplingParams(temperature=1.0, top_k=1 + row % 9),
    "top_p": lambda row: SamplingParams(temperature=1.0, top_p=0.5 + (row % 5) / 10),
    "top_k with top_p, some rows without": lambda row: SamplingParams(
        temperature=1.0, top_k=None if row % 4 == 0 else 3 + row, top_p=0.8 if row % 2 else 1.0),
    "min_p": lambda row: SamplingParams(temperature=1.2, min_p=(row % 4) / 10),
    "greedy rows beside top_p": lambda row: SamplingParams(temperature=(row % 2) * 1.0, top_p=0.9),
    "seeded among unseeded": lambda row: SamplingParams(temperature=1.0, seed=row if row % 3 == 1 else None),
    "every row seeded, top_k": lambda row: SamplingParams(temperature=0.9, seed=100 + row, top_k=4 + row % 5),
    "every row seeded": lambda row: SamplingParams(temperature=0.9, seed=100 + row),
    "penalties": lambda row: SamplingParams(
        temperature=(row % 2) * 0.8, repetition_penalty=1.0 + (row % 3) / 4, frequency_penalty=0.3 * (row % 2),
        presence_penalty=0.5 if row % 5 else 0.0),
    "min_tokens and logit_bias": lambda row: SamplingParams(
        temperature=0.7, min_tokens=2, logit_bias=((7, 3.0), (row % VOCAB_SIZE, -2.0))),
    "logprobs": lambda row: SamplingParams(
        temperature=(row % 2) * 1.1, top_p=0.9, logprobs=None if row % 3 == 0 else row % 4, seed=row or None),
    "everything": lambda row: SamplingParams(
        temperature=(row % 4) * 0.4, top_k=2 + row, top_p=0.85, min_p=0.02, seed=row if row % 2 else None,
        repetition_penalty=1.1, presence_penalty=0.2, logprobs=2),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("grammar", [False, True])
def test_chunks_draw_the_same_tokens_and_logprobs_as_one_pass(name: str, grammar: bool) -> None:
    logits = torch.randn(NUM_ROWS, VOCAB_SIZE, generator=torch.Generator().manual_seed(7)) * 3  # [N, V]
    whole = run(CASES[name], None, logits, grammar)
    for rows in CHUNK_ROWS:
        chunked = run(CASES[name], chunk_bytes(rows), logits, grammar)
        assert chunked.sampled_token_ids == whole.sampled_token_ids, (name, rows)
        assert chunked.logprobs == whole.logprobs, (name, rows)
    default = run(CASES[name], SAMPLER_CHUNK_BYTES, logits, grammar)  # one chunk at this vocabulary
    assert default.sampled_token_ids == whole.sampled_token_ids


def test_the_draws_are_random_draws_not_argmaxes() -> None:
    logits = torch.zeros(NUM_ROWS, VOCAB_SIZE)  # uniform: a draw that ignored the noise would give token 0
    tokens = run(CASES["seeded among unseeded"], chunk_bytes(3), logits).sampled_token_ids
    assert len(set(tokens)) > NUM_ROWS // 2


def test_rows_per_chunk_fits_the_budget() -> None:
    assert rows_per_chunk(151_936, SAMPLER_CHUNK_BYTES) == 34
    assert rows_per_chunk(128_256, SAMPLER_CHUNK_BYTES) == 40
    assert rows_per_chunk(151_936, 1) == 1  # one row whatever the budget
    assert rows_per_chunk(151_936, None) is None
    for budget in (chunk_bytes(1), chunk_bytes(5), None):
        for num_rows in (0, 1, 5, 23):
            chunks = row_chunks(num_rows, VOCAB_SIZE, budget)
            assert [row for chunk in chunks for row in range(num_rows)[chunk]] == list(range(num_rows))


class LiveBytes(TorchDispatchMode):
    """The peak bytes of the storages that ops run under it allocate, counted while some tensor holds
    them (the CPU has no allocator statistics; inputs made before the mode are not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, list[int]] = {}  # storage address -> [bytes, tensors holding it]
        self.total = self.peak = 0

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.total -= entry[0]
            del self.live[key]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {id(arg) for arg in tree_flatten((args, kwargs))[0] if isinstance(arg, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor) or id(tensor) in inputs:
                continue  # an in-place op's result is its input
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key not in self.live:
                self.live[key] = [storage.nbytes(), 0]
                self.total += storage.nbytes()
                self.peak = max(self.peak, self.total)
            self.live[key][1] += 1
            weakref.finalize(tensor, self._release, key)
        return out


def test_chunks_bound_the_profile_steps_temporaries() -> None:
    # The profile's sampler step (top-p 0.9) on bf16 logits: the whole batch keeps the float32 copy and
    # the shared noise (8 B/logit); the staged temporaries are one chunk's, not the batch's.
    num_rows, vocab_size = 64, 4096
    logits = (torch.randn(num_rows, vocab_size) * 3).bfloat16()  # [N, V]
    batch = build_sampling_batch(profile_sampling_requests(num_rows), VocabInfo(vocab_size, frozenset()), CPU)
    whole_batch = num_rows * vocab_size * 8
    peaks = {}
    for budget in (None, 4 * vocab_size * STAGED_BYTES_PER_LOGIT):
        with LiveBytes() as live:
            Sampler(torch.Generator().manual_seed(0), budget).sample(logits, batch)
        peaks[budget] = live.peak
    chunked = 4 * vocab_size * STAGED_BYTES_PER_LOGIT
    assert whole_batch < peaks[chunked] <= whole_batch + chunked
    assert peaks[None] > whole_batch + 5 * chunked  # the unchunked path holds every row's temporaries


STAGED_WITHOUT_EDITS = ("top_k", "top_p", "top_k with top_p, some rows without", "min_p", "greedy rows beside top_p",
                        "seeded among unseeded", "every row seeded, top_k", "every row seeded")
"""Cases on the staged path that edit nothing: on CUDA they read bf16 logits (the greedy rows' argmax too)."""


def as_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dispatch a CUDA device with the fused kernel gets (none of these cases reaches the kernel)."""
    monkeypatch.setattr("conveyor.worker.sampler.cdf_sample_supported", lambda device: True)


@pytest.mark.parametrize("name", STAGED_WITHOUT_EDITS)
def test_staged_path_on_bf16_logits_draws_what_their_float32_copy_draws(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    logits = (torch.randn(NUM_ROWS, VOCAB_SIZE, generator=torch.Generator().manual_seed(7)) * 3).bfloat16()
    converted = run(CASES[name], chunk_bytes(3), logits)  # the CPU's dispatch: one float32 copy, then chunks
    as_on_cuda(monkeypatch)
    for rows in (1, 3, None):  # chunk by chunk, each promoted to float32 as it is scaled
        read_as_bf16 = run(CASES[name], chunk_bytes(rows) if rows else None, logits)
        assert read_as_bf16.sampled_token_ids == converted.sampled_token_ids, (name, rows)


def test_unedited_top_p_step_on_bf16_logits_keeps_no_float32_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    # A top-p batch without edits as CUDA dispatches it: the whole batch keeps only the shared noise (4 B/logit)
    # beside one chunk's temporaries; the float32 copy of the logits (another 4 B/logit) is never made.
    num_rows, vocab_size = 64, 4096
    logits = (torch.randn(num_rows, vocab_size) * 3).bfloat16()  # [N, V]
    requests = [SamplingRequest(SamplingParams(temperature=1.0, top_p=0.9), [0], 1)] * num_rows
    batch = build_sampling_batch(requests, VocabInfo(vocab_size, frozenset()), CPU)
    chunk = 4 * vocab_size * STAGED_BYTES_PER_LOGIT
    as_on_cuda(monkeypatch)
    with LiveBytes() as live:
        Sampler(torch.Generator().manual_seed(0), chunk).sample(logits, batch)
    noise = num_rows * vocab_size * 4
    assert noise < live.peak <= noise + chunk
