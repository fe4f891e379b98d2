"""Residual add + RMSNorm in one launch (kernels/add_rms_norm.py): both outputs equal the unfused sequence
-- a torch add, then rms_norm.py's kernel -- bit for bit, and its torch reference to the bit where the
float32 statistics are exact.

On the CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1 with triton importable). Its
float32 -> bf16 cast truncates where the GPU rounds to nearest even, so interpreted bf16 rows are
compared with the interpreted unfused kernel and get exact adds (values on a 1/16 grid: no rounding to
disagree on); fp16 casts round correctly there, so fp16 rows are compared with the torch reference.
"""

from __future__ import annotations

import os

import pytest
import torch

from conveyor.kernels.add_rms_norm import (
    add_rms_norm,
    add_rms_norm_partials,
    add_rms_norm_partials_ref,
    add_rms_norm_ref,
)
from conveyor.kernels.rms_norm import rms_norm
from conveyor.kernels.splitk_linear import PartialSums
from conveyor.kernels.triton_compat import HAS_TRITON

INTERPRET = HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"
CUDA = HAS_TRITON and torch.cuda.is_available()
WIDTHS = [48, 300, 1024, 1000]  # ragged widths leave a masked tail in the power-of-two block
EPS = 1e-6


def grid_rows(num_rows: int, num_cols: int, dtype: torch.dtype, seed: int, device: str = "cpu") -> torch.Tensor:
    """[num_rows, num_cols] of k / 16, |k| < 128: sums of two are exact in 16 bits, sums of squares in float32."""
    codes = torch.randint(-127, 128, (num_rows, num_cols), generator=torch.Generator().manual_seed(seed))
    return (codes / 16).to(dtype).to(device)


def _unfused(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the decoder computed before the fusion: a torch add, then the RMSNorm kernel."""
    total = x + residual
    return rms_norm(total, weight, EPS), total


def _assert_bits_equal(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    for out, ref in zip(got, want, strict=True):
        assert out.dtype == ref.dtype and out.shape == ref.shape
        assert torch.equal(out, ref), f"{(out != ref).sum().item()} of {out.numel()} elements differ"


def test_reference_is_the_eager_add_then_norm() -> None:
    x, residual = grid_rows(3, 64, torch.bfloat16, 0), grid_rows(3, 64, torch.bfloat16, 1)
    weight = torch.randn(64).to(torch.bfloat16)
    normed, total = add_rms_norm_ref(x, residual, weight, EPS)
    assert torch.equal(total, x + residual)
    x32 = total.float()
    assert torch.equal(normed, weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)).to(total.dtype))


@pytest.mark.skipif(not INTERPRET, reason="needs Triton's interpreter: TRITON_INTERPRET=1")
@pytest.mark.parametrize("num_cols", WIDTHS)
def test_interpreted_fp16_equals_the_torch_reference(num_cols: int) -> None:
    x, residual = grid_rows(5, num_cols, torch.float16, 0), grid_rows(5, num_cols, torch.float16, 1)
    weight = torch.randn(num_cols, generator=torch.Generator().manual_seed(2)).to(torch.float16)
    _assert_bits_equal(add_rms_norm(x, residual, weight, EPS), add_rms_norm_ref(x, residual, weight, EPS))


@pytest.mark.skipif(not INTERPRET, reason="needs Triton's interpreter: TRITON_INTERPRET=1")
@pytest.mark.parametrize("num_cols", WIDTHS)
def test_interpreted_bf16_equals_the_unfused_kernels(num_cols: int) -> None:
    x, residual = grid_rows(5, num_cols, torch.bfloat16, 3), grid_rows(5, num_cols, torch.bfloat16, 4)
    weight = torch.randn(num_cols, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    _assert_bits_equal(add_rms_norm(x, residual, weight, EPS), _unfused(x, residual, weight))


@pytest.mark.skipif(not INTERPRET, reason="needs Triton's interpreter: TRITON_INTERPRET=1")
def test_interpreted_strided_rows_and_no_rows() -> None:
    wide = grid_rows(4, 2 * 96, torch.float16, 6)
    x, residual = wide[:, :96], grid_rows(4, 96, torch.float16, 7)  # x [4, 96] with row stride 192
    weight = torch.ones(96, dtype=torch.float16)
    _assert_bits_equal(add_rms_norm(x, residual, weight, EPS), add_rms_norm_ref(x, residual, weight, EPS))
    empty = torch.empty(0, 96, dtype=torch.float16)
    assert [t.shape for t in add_rms_norm(empty, empty, weight, EPS)] == [(0, 96), (0, 96)]


@pytest.mark.skipif(not INTERPRET, reason="needs Triton's interpreter: TRITON_INTERPRET=1")
@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("num_cols", WIDTHS)
def test_interpreted_partials_equal_the_kernel_on_their_total(num_cols: int, num_splits: int) -> None:
    """The S float32 partials added in split order and rounded once, then the same add and norm: the bits of
    `add_rms_norm` on `PartialSums.total()` (fp16: the interpreter rounds its casts correctly)."""
    generator = torch.Generator().manual_seed(num_cols + num_splits)
    partials = torch.randn(num_splits, 5, num_cols, generator=generator)  # [S, T, H] float32, not on a grid
    x = PartialSums(partials, torch.float16)
    residual = grid_rows(5, num_cols, torch.float16, 8)
    weight = torch.randn(num_cols, generator=generator).to(torch.float16)
    got = add_rms_norm_partials(x, residual, weight, EPS)
    _assert_bits_equal(got, add_rms_norm(x.total(), residual, weight, EPS))
    normed_ref, total_ref = add_rms_norm_partials_ref(x, residual, weight, EPS)
    assert torch.equal(got[1], total_ref)  # torch's 16-bit add rounds the float32 sum once, as the kernel does
    torch.testing.assert_close(got[0], normed_ref, rtol=1e-3, atol=1e-3)  # float32 statistics' order: an ulp


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA and Triton")
@pytest.mark.parametrize("num_cols", [*WIDTHS, 4096])
def test_gpu_bf16_equals_the_unfused_kernels(num_cols: int) -> None:
    generator = torch.Generator(device="cuda").manual_seed(num_cols)
    x, residual = (torch.randn(300, num_cols, device="cuda", generator=generator).to(torch.bfloat16) for _ in "xr")
    weight = torch.randn(num_cols, device="cuda", generator=generator).to(torch.bfloat16)
    got = add_rms_norm(x, residual, weight, EPS)
    _assert_bits_equal(got, _unfused(x, residual, weight))
    normed_ref, _ = add_rms_norm_ref(x, residual, weight, EPS)  # eager: float32 summation order may move an ulp
    assert (got[0] != normed_ref).float().mean() < 1e-3
