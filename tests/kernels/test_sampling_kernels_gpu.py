"""The contract both one-launch samplers keep on the GPU (gumbel_sample: Gumbel-max, Philox per element;
cdf_sample: inverse CDF, one uniform a row): draws follow softmax(logits / T), -inf tokens are never
drawn, and the seed alone decides the draw. Each kernel's own checks stay in its test file."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from sampling_stats import CHI_SQUARE_999, PROBS, chi_square, tempered

from conveyor.kernels.cdf_sample import cdf_sample
from conveyor.kernels.gumbel_sample import gumbel_sample
from conveyor.kernels.triton_compat import HAS_TRITON

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and Triton"),
]
Sampler = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
SAMPLERS = pytest.mark.parametrize("sample", [gumbel_sample, cdf_sample], ids=["gumbel", "cdf"])
TILE = 4096
"""Columns a program of either kernel reads (both modules' BLOCK)."""


def device_seed(seed: int) -> torch.Tensor:
    return torch.tensor([seed], dtype=torch.int64, device="cuda")


@SAMPLERS
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_kernel_draws_from_the_tempered_softmax(sample: Sampler, temperature: float) -> None:
    num_rows = 50000  # one launch: the row keys every draw
    logits = PROBS.log().to("cuda").expand(num_rows, 8).contiguous().bfloat16()
    probs = torch.softmax(logits.float()[0].cpu(), dim=-1)  # bf16 rounding moved the logits a little
    tokens = sample(logits, torch.full((num_rows,), temperature, device="cuda"), device_seed(7))
    assert chi_square(tokens, tempered(probs, temperature)) < CHI_SQUARE_999[7]


@SAMPLERS
def test_kernel_never_picks_masked_tokens(sample: Sampler) -> None:
    num_rows, vocab_size = 512, 151936
    logits = torch.randn(num_rows, vocab_size, device="cuda").bfloat16()
    logits[:, 1::2] = float("-inf")
    logits[:, TILE:3 * TILE] = float("-inf")  # whole tiles masked
    logits[0, :] = float("-inf")  # a fully masked row: column 0, as torch.argmax
    tokens = sample(logits, torch.full((num_rows,), 5.0, device="cuda"), device_seed(3))
    assert tokens[0] == 0 and (tokens[1:] % 2 == 0).all()
    assert not ((tokens >= TILE) & (tokens < 3 * TILE)).any()


@SAMPLERS
def test_kernel_same_seed_same_tokens_other_seed_other_tokens(sample: Sampler) -> None:
    num_rows, vocab_size = 256, 128256
    logits = torch.randn(num_rows, vocab_size, device="cuda").bfloat16()
    temperature = torch.ones(num_rows, device="cuda")
    first = sample(logits, temperature, device_seed(11))
    assert torch.equal(first, sample(logits, temperature, device_seed(11)))
    other = sample(logits, temperature, device_seed(12))
    assert (first != other).float().mean() > 0.9  # near-flat rows over 128k tokens: almost never equal
