"""Gumbel-max sampling: the reference draws from softmax(logits / T) (CPU); the kernel computes the
reference on its own uniforms, is exact argmax at temperature 0 and follows the distribution (GPU)."""

from __future__ import annotations

import pytest
import torch
from sampling_stats import CHI_SQUARE_999, PROBS, chi_square, tempered

from conveyor.kernels.gumbel_sample import (
    gumbel_sample,
    gumbel_sample_ref,
    gumbel_sample_supported,
    gumbel_uniforms,
)
from conveyor.kernels.triton_compat import HAS_TRITON

gpu = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and Triton")


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_reference_draws_from_the_tempered_softmax(temperature: float) -> None:
    num_rows = 20000
    logits = (PROBS.log() + 3.0).expand(num_rows, 8)  # a shift changes nothing
    uniform = torch.rand(num_rows, 8, generator=torch.Generator().manual_seed(int(temperature * 10)))
    tokens = gumbel_sample_ref(logits, torch.full((num_rows,), temperature), uniform)
    assert chi_square(tokens, tempered(PROBS, temperature)) < CHI_SQUARE_999[7]


def test_reference_with_masked_tokens_draws_from_the_rest() -> None:
    num_rows = 20000
    logits = PROBS.log().expand(num_rows, 8).clone()
    logits[:, 1::2] = float("-inf")
    uniform = torch.rand(num_rows, 8, generator=torch.Generator().manual_seed(5))
    tokens = gumbel_sample_ref(logits, torch.ones(num_rows), uniform)
    assert (tokens % 2 == 0).all()
    kept = PROBS[0::2] / PROBS[0::2].sum()
    assert chi_square(tokens // 2, kept) < CHI_SQUARE_999[3]


def test_reference_greedy_rows_are_exact_argmax_with_lowest_index_ties() -> None:
    logits = torch.randn(64, 1000).round(decimals=1)  # many ties at the maximum
    logits[3, :] = 2.0  # all tied: column 0
    uniform = torch.rand(64, 1000, generator=torch.Generator().manual_seed(0))
    tokens = gumbel_sample_ref(logits, torch.zeros(64), uniform)
    assert torch.equal(tokens, logits.argmax(dim=-1)) and tokens[3] == 0
    first_max = [int((row == row.max()).nonzero()[0]) for row in logits]
    assert tokens.tolist() == first_max


def test_reference_never_picks_minus_inf_even_at_extreme_uniforms() -> None:
    logits = torch.full((4, 16), float("-inf"))
    logits[:, 5] = -50.0  # the only finite token, and a low one
    uniform = torch.rand(4, 16, generator=torch.Generator().manual_seed(1))
    uniform[0] = 0.0  # exactly 0 and exactly 1: clamped, so the noise stays finite
    uniform[1] = 1.0
    uniform[2, 5], uniform[3, 5] = 0.0, 1.0
    tokens = gumbel_sample_ref(logits, torch.tensor([1.0, 1e-2, 1.0, 100.0]), uniform)
    assert tokens.tolist() == [5, 5, 5, 5]
    all_masked = torch.full((2, 16), float("-inf"))
    assert gumbel_sample_ref(all_masked, torch.tensor([0.0, 1.0]), uniform[:2]).tolist() == [0, 0]


def test_reference_reads_bf16_logits_as_their_float32_values() -> None:
    logits = torch.randn(32, 500).bfloat16()
    uniform = torch.rand(32, 500, generator=torch.Generator().manual_seed(2))
    temperature = torch.rand(32) + 0.1
    assert torch.equal(gumbel_sample_ref(logits, temperature, uniform),
                       gumbel_sample_ref(logits.float(), temperature, uniform))


def test_kernel_is_cuda_only() -> None:
    assert not gumbel_sample_supported(torch.device("cpu"))
    if not HAS_TRITON:
        with pytest.raises(RuntimeError, match="needs Triton"):
            gumbel_sample(torch.zeros(1, 8), torch.ones(1), torch.zeros(1, dtype=torch.int64))


def device_seed(seed: int) -> torch.Tensor:
    return torch.tensor([seed], dtype=torch.int64, device="cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab_size", [49152, 128256, 151936])
@pytest.mark.parametrize("num_rows", [1, 7, 256])
def test_kernel_greedy_is_torch_argmax(num_rows: int, vocab_size: int, dtype: torch.dtype) -> None:
    logits = (torch.randn(num_rows, vocab_size, device="cuda") * 4).to(dtype)  # bf16: ties at the max
    logits[-1, [10, 5000, vocab_size - 1]] = 100.0  # a tie across tiles: the lowest column
    tokens = gumbel_sample(logits, torch.zeros(num_rows, device="cuda"), device_seed(0))
    assert tokens.dtype == torch.int64 and tokens.is_cuda
    assert torch.equal(tokens, logits.argmax(dim=-1)) and tokens[-1] == 10


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_computes_the_reference_on_its_uniforms(dtype: torch.dtype) -> None:
    num_rows, vocab_size = 256, 128256
    logits = (torch.randn(num_rows, vocab_size, device="cuda") * 2).to(dtype)
    temperature = torch.rand(num_rows, device="cuda") * 2 + 0.05
    temperature[::5] = 0.0  # greedy rows in the same launch
    seed = device_seed(1234)
    tokens = gumbel_sample(logits, temperature, seed)
    ref = gumbel_sample_ref(logits, temperature, gumbel_uniforms(num_rows, vocab_size, seed))
    # the kernel scores in base 2 with a reciprocal: a near-tie may round the other way, rarely
    assert int((tokens != ref).sum()) <= 1
    assert torch.equal(tokens[::5], logits[::5].argmax(dim=-1))
