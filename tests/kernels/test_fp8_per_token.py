"""Per-token FP8 activation scales (kernels/fp8_quant.py `quantize_fp8_per_token`, kernels/fp8_linear.py
`fp8_linear_per_token`): one scale per row, so a row's values do not depend on any other row's; the
Triton launch gives the torch reference's scales and bits (on the CPU under Triton's interpreter, on a
GPU by the marked tests); the row-wise `_scaled_mm` equals its float32 reference."""

from __future__ import annotations

import os

import pytest
import torch

from conveyor.kernels.fp8_linear import (
    fp8_linear,
    fp8_linear_per_token,
    fp8_linear_per_token_ref,
    per_token_weight_scales,
    quantize_weight_fp8,
    quantize_weight_fp8_per_channel,
)
from conveyor.kernels.fp8_quant import (
    FP8_DTYPE,
    quantize_fp8_per_token,
    quantize_fp8_per_token_ref,
)
from conveyor.kernels.triton_compat import HAS_TRITON

INTERPRET = HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"
CUDA = HAS_TRITON and torch.cuda.is_available()


def exact_activation(num_elements: int, seed: int) -> torch.Tensor:
    """[num_elements] float32 of e4m3-representable values times 2^-3, -448 among them (max|x| = 56)."""
    codes = torch.randint(0, 256, (num_elements,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x10  # e4m3fn's NaNs (S.1111.111) -> a normal value
    values = codes.view(FP8_DTYPE).float()
    values[num_elements // 2] = -448.0
    return values * 0.125


def _rows_scaled_apart(num_rows: int, num_cols: int, dtype: torch.dtype) -> torch.Tensor:
    """[num_rows, num_cols] of e4m3 values, row t times 2^(t-3): each row's max|x| is 56 * 2^t / 8."""
    rows = [exact_activation(num_cols, seed=t) * 2.0**t for t in range(num_rows)]
    return torch.stack(rows).to(dtype)


def test_each_row_gets_its_own_scale_and_round_trips_exactly() -> None:
    x = _rows_scaled_apart(4, 300, torch.float32)
    x_q, scales = quantize_fp8_per_token_ref(x)
    assert scales.shape == (4, 1) and x_q.dtype == FP8_DTYPE
    assert torch.equal(scales.flatten(), torch.tensor([56.0 * 2.0**t / 448.0 for t in range(4)]))
    assert torch.equal(x_q.float() * scales, x)  # exact: every row is e4m3 values times a power of two


def test_an_outlier_row_leaves_the_other_rows_alone() -> None:
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with_outlier = x.clone()
    with_outlier[0, 0] = 1e4
    assert torch.equal(quantize_fp8_per_token_ref(x)[0][1:].view(torch.uint8),
                       quantize_fp8_per_token_ref(with_outlier)[0][1:].view(torch.uint8))


def test_the_row_wise_linear_is_closer_to_bf16_than_the_per_tensor_one_beside_an_outlier_row() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, 128, generator=gen).to(torch.bfloat16)
    x[0] *= 2e4  # one loud token: a per-tensor scale pushes the other 15 rows into e4m3's subnormals
    weight, weight_scale = quantize_weight_fp8(torch.randn(64, 128, generator=gen))
    exact = x.float() @ (weight.float() * weight_scale).t()
    row_out = fp8_linear_per_token(x, weight, per_token_weight_scales(weight_scale, 64))
    row_err = (row_out.float() - exact)[1:].norm() / exact[1:].norm()
    tensor_err = (fp8_linear(x, weight, weight_scale).float() - exact)[1:].norm() / exact[1:].norm()
    assert row_err < 0.05 and row_err < tensor_err / 2, (row_err, tensor_err)


@pytest.mark.parametrize("num_rows", [1, 7, 64])
def test_the_row_wise_scaled_mm_equals_its_reference(num_rows: int) -> None:
    gen = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, 128, generator=gen).to(torch.bfloat16)
    weight, weight_scale = quantize_weight_fp8(torch.randn(48, 128, generator=gen))
    bias = torch.randn(48, generator=gen).to(torch.bfloat16)
    scales = per_token_weight_scales(weight_scale, 48)
    out, ref = fp8_linear_per_token(x, weight, scales, bias), fp8_linear_per_token_ref(x, weight, scales, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (num_rows, 48)
    assert (out.float() - ref.float()).norm() / ref.float().norm() < 0.01


def test_per_channel_weights_keep_a_quiet_channel_out_of_the_subnormals() -> None:
    """ptpc_fp8's weights: channel n scaled by its own max, so channels 2^10 apart both round-trip to 2^-4."""
    weight = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    weight[0] *= 1024.0
    weight_q, scales = quantize_weight_fp8_per_channel(weight)
    assert scales.shape == (1, 8) and weight_q.dtype == FP8_DTYPE
    back = weight_q.float() * scales.t()  # [N, K]
    assert torch.all((back - weight).abs() <= weight.abs() * 2.0**-4 + scales.t() * 2.0**-9)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    out, ref = fp8_linear_per_token(x, weight_q, scales), fp8_linear_per_token_ref(x, weight_q, scales)
    assert (out.float() - ref.float()).norm() / ref.float().norm() < 0.01


def test_an_empty_row_takes_the_floor_scale() -> None:
    x_q, scales = quantize_fp8_per_token_ref(torch.empty(3, 0))
    assert x_q.shape == (3, 0) and torch.all(scales == quantize_fp8_per_token_ref(torch.zeros(1, 4))[1])


def _same(x: torch.Tensor) -> None:
    x_q, scales = quantize_fp8_per_token(x)
    ref_q, ref_scales = quantize_fp8_per_token_ref(x)
    assert torch.equal(scales.cpu(), ref_scales.cpu()), (scales, ref_scales)
    assert torch.equal(x_q.view(torch.uint8).cpu(), ref_q.view(torch.uint8).cpu())


@pytest.mark.skipif(not INTERPRET, reason="needs Triton's interpreter: TRITON_INTERPRET=1 with triton importable")
@pytest.mark.parametrize("num_cols", [1, 1024, 2 * 1024 + 17])  # one tile, its edge, a ragged last tile
def test_interpreted_launch_gives_the_torch_bits(num_cols: int) -> None:
    x = _rows_scaled_apart(3, num_cols, torch.float32)
    x[1] = 0.0  # an all-zero row: the floor scale and zeros
    _same(x)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA and Triton")
@pytest.mark.parametrize("shape", [(1, 4096), (256, 14336), (4096, 4096)])
def test_gpu_launch_gives_the_torch_bits_on_normal_activations(shape: tuple[int, int]) -> None:
    x = (torch.randn(shape, generator=torch.Generator(device="cuda").manual_seed(2), device="cuda") * 3.0)
    x = x.to(torch.bfloat16)
    x[0, 0] = 1e4
    _same(x)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA and Triton")
@pytest.mark.parametrize("num_rows", [1, 256, 4096])
def test_gpu_row_wise_linear_equals_its_reference(num_rows: int) -> None:
    x = torch.randn(num_rows, 4096, device="cuda", dtype=torch.bfloat16)
    weight, weight_scale = quantize_weight_fp8(torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16))
    scales = per_token_weight_scales(weight_scale, 1024)
    out, ref = fp8_linear_per_token(x, weight, scales), fp8_linear_per_token_ref(x, weight, scales)
    assert (out.float() - ref.float()).norm() / ref.float().norm() < 0.01
