"""--quantization fp8's matmul (kernels/fp8_linear.py): per-tensor weight quantization within e4m3's
roundoff, `torch._scaled_mm` (it runs on the CPU too) equal to the float32 reference over the same
quantized operands, and within a stated bound of the 16-bit matmul."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conveyor.kernels.fp8_linear import (
    FP8_WEIGHT_DTYPE,
    fp8_linear,
    fp8_linear_ref,
    quantize_weight_fp8,
)

OUTPUT_BOUND = 0.05
"""||fp8_linear - linear|| / ||linear|| for unit-variance inputs (measured ~0.024: both operands carry
e4m3's 2^-4 relative roundoff, which the K-term sums average down)."""


def operands(num_rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, 128, generator=gen).to(torch.bfloat16)  # [T, K]
    weight = (torch.randn(96, 128, generator=gen) * 0.05).to(torch.bfloat16)  # [N, K]
    return x, weight, torch.randn(96, generator=gen).to(torch.bfloat16)


def test_weight_quantization_error() -> None:
    _, weight, _ = operands(1)
    quantized, scale = quantize_weight_fp8(weight)
    assert quantized.dtype == FP8_WEIGHT_DTYPE and scale.shape == () and scale.dtype == torch.float32
    back, exact = quantized.float() * scale, weight.float()
    assert back.abs().max() == pytest.approx(exact.abs().max(), rel=2.0**-4)  # max|W| maps onto 448
    # e4m3: 2^-4 relative for normal values, half of the subnormal step (2^-10 of the scale) below them.
    assert ((back - exact).abs() <= torch.maximum(exact.abs() * 2.0**-4, scale * 2.0**-10) * 1.0001).all()


@pytest.mark.parametrize("num_rows", [1, 3, 16, 300])
def test_scaled_mm_equals_the_reference(num_rows: int) -> None:
    x, weight, bias = operands(num_rows, seed=num_rows)
    quantized, scale = quantize_weight_fp8(weight)
    out = fp8_linear(x, quantized, scale, bias)
    assert out.shape == (num_rows, 96) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, fp8_linear_ref(x, quantized, scale, bias), rtol=2.0**-7, atol=1e-3)
    full = F.linear(x.float(), weight.float(), bias.float())
    assert float((out.float() - full).norm() / full.norm()) <= OUTPUT_BOUND


def test_a_zero_input_gives_the_bias_not_nan() -> None:
    _, weight, bias = operands(1)
    quantized, scale = quantize_weight_fp8(weight)
    out = fp8_linear(torch.zeros(4, 128, dtype=torch.bfloat16), quantized, scale, bias)
    assert torch.equal(out, bias.expand(4, -1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_rows", [1, 7, 16, 300, 4096])
def test_cuda_scaled_mm_equals_the_reference(num_rows: int) -> None:
    x, weight, bias = (t.cuda() for t in operands(num_rows, seed=num_rows))
    quantized, scale = quantize_weight_fp8(weight)
    out = fp8_linear(x, quantized, scale, bias)
    torch.testing.assert_close(out, fp8_linear_ref(x, quantized, scale, bias), rtol=2.0**-7, atol=1e-2)
