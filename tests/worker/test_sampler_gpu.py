"""The sampler on CUDA: bf16 logits read as they are (fused and staged), greedy rows exact, no host sync, and
nothing left for the first request to compile after warm-up."""

from __future__ import annotations

import pathlib

import pytest
import torch

from conveyor.kernels.triton_compat import HAS_TRITON
from conveyor.sampling_params import SamplingParams
from conveyor.worker.sampler import Sampler, SamplingPath, reads_lm_head_logits, sampling_path
from conveyor.worker.sampling_metadata import SamplingBatch, SamplingRequest, VocabInfo, build_sampling_batch
from conveyor.worker.warmup import compiled_kernel_count, warm_up_sampler
from runner_harness import make_runner, write_tiny_llama

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON),
                                                  reason="needs CUDA and Triton")]

CUDA = torch.device("cuda")
VOCAB = VocabInfo(vocab_size=128256, eos_token_ids=frozenset({2}))


def batch_of(temperatures: list[float]) -> SamplingBatch:
    requests = [SamplingRequest(SamplingParams(temperature=t), [0, 1], 1) for t in temperatures]
    return build_sampling_batch(requests, VOCAB, CUDA)


def bf16_logits(num_rows: int) -> torch.Tensor:
    return (torch.randn(num_rows, VOCAB.vocab_size, device=CUDA) * 3).bfloat16()  # [N, V], ties likely


def test_all_greedy_batch_is_argmax_of_the_bf16_logits() -> None:
    logits, batch = bf16_logits(256), batch_of([0.0] * 256)
    assert sampling_path(batch, True) is SamplingPath.GREEDY and reads_lm_head_logits(batch, True)
    tokens = Sampler(torch.Generator(device=CUDA).manual_seed(0)).sample(logits, batch)
    assert tokens.is_cuda and torch.equal(tokens, logits.argmax(dim=-1))


def test_mixed_batch_is_fused_and_its_greedy_rows_are_exact() -> None:
    temperatures = [0.0 if row % 3 == 0 else 0.8 for row in range(96)]
    logits, batch = bf16_logits(96), batch_of(temperatures)
    assert sampling_path(batch, True) is SamplingPath.FUSED
    before = logits.clone()
    tokens = Sampler(torch.Generator(device=CUDA).manual_seed(0)).sample(logits, batch)
    assert torch.equal(logits, before)  # read, never written
    assert torch.equal(tokens[::3], logits[::3].argmax(dim=-1))
    assert (tokens[1::3] != logits[1::3].argmax(dim=-1)).any()  # near-flat rows at 0.8: draws, not argmax


def test_fused_path_never_syncs_with_the_host() -> None:
    sampler = Sampler(torch.Generator(device=CUDA).manual_seed(0))
    for batch in (batch_of([1.0] * 64), batch_of([1.0, 0.0] * 32)):  # all random; mixed (index_copy_)
        logits = bf16_logits(64)
        sampler.sample(logits, batch)  # compiles outside the checked region
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            tokens = sampler.sample(logits, batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert tokens.is_cuda and tokens.shape == (64,)


def test_runner_seed_reproduces_fused_draws() -> None:
    logits, batch = bf16_logits(32), batch_of([1.0] * 32)
    first = Sampler(torch.Generator(device=CUDA).manual_seed(5)).sample(logits, batch)
    again = Sampler(torch.Generator(device=CUDA).manual_seed(5)).sample(logits, batch)
    sampler = Sampler(torch.Generator(device=CUDA).manual_seed(5))
    sampler.sample(logits, batch)
    assert torch.equal(first, again)
    assert not torch.equal(first, sampler.sample(logits, batch))  # the generator moved: a new seed


def test_after_sampler_warm_up_the_fused_path_compiles_nothing(tmp_path: pathlib.Path) -> None:
    runner = make_runner(write_tiny_llama(tmp_path / "tiny"), num_blocks=64, device="cuda", dtype="bfloat16")
    warm_up_sampler(runner)
    compiled = compiled_kernel_count()
    vocab = runner.vocab
    for temperatures in ([0.7] * 5, [0.7, 0.0, 1.3], [0.0] * 2):
        requests = [SamplingRequest(SamplingParams(temperature=t), [0, 1], 1) for t in temperatures]
        logits = torch.randn(len(requests), vocab.vocab_size, device=CUDA).bfloat16()  # as the LM head's
        runner.sampler(logits, build_sampling_batch(requests, vocab, CUDA))
    torch.cuda.synchronize()
    assert compiled_kernel_count() == compiled


def test_staged_path_on_bf16_chunks_draws_the_float32_copys_tokens() -> None:
    # Top-p with greedy rows beside it, no edits: the staged path reads the bf16 logits one row chunk at a
    # time (no whole-batch float32 copy) and draws what it draws from their float32 copy.
    requests = [SamplingRequest(SamplingParams(temperature=(row % 3) * 0.5, top_p=0.9), [0, 1], 1)
                for row in range(96)]
    logits, batch = bf16_logits(96), build_sampling_batch(requests, VOCAB, CUDA)
    assert sampling_path(batch, True) is SamplingPath.STAGED and reads_lm_head_logits(batch, True)
    chunk_bytes = 16 * VOCAB.vocab_size * 48  # chunks of 16 rows
    as_bf16 = Sampler(torch.Generator(device=CUDA).manual_seed(3), chunk_bytes).sample(logits, batch)
    from_copy = Sampler(torch.Generator(device=CUDA).manual_seed(3), chunk_bytes).sample(logits.float(), batch)
    assert torch.equal(as_bf16, from_copy)
