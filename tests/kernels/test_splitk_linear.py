"""Split-K x @ W^T into float32 partials (kernels/splitk_linear.py), summed by add_rms_norm_partials.

On the CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1 with triton importable) in float32,
and in fp16 where the SwiGLU's roundings to the dtype must show: its bf16 casts and dots are wrong there (the
probe got garbage), so the bf16 cases are the GPU tests. Float32 partials differ from torch's only in the dot's
summation order (a few float32 ulps). The plan table and the
torch references run everywhere; the sm_90 compile test needs triton without the interpreter.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from conveyor.kernels.add_rms_norm import add_rms_norm, add_rms_norm_partials, add_rms_norm_ref
from conveyor.kernels.splitk_linear import (
    PartialSums,
    SplitKPlan,
    splitk_linear,
    splitk_linear_ref,
    splitk_plan,
    swiglu_ref,
)
from conveyor.kernels.triton_compat import HAS_TRITON

INTERPRET = HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"
CUDA = HAS_TRITON and torch.cuda.is_available()
EPS = 1e-6
QWEN3_O, QWEN3_DOWN = (1024, 2048), (1024, 3072)  # Qwen3-0.6B's (N, K): o_proj, down_proj
RAGGED = [(5, 48, 200), (37, 80, 272), (1, 16, 40)]  # (M, N, K): tails in M, N and K against 16x32x32 tiles


def _plan(splits: int, block_k: int = 32) -> SplitKPlan:
    """A small tile for interpreted shapes: the M, N and K tails are partial tiles."""
    return SplitKPlan(16, 32, block_k, num_warps=4, num_stages=2, splits=splits)


def _operands(m: int, n: int, k: int, silu: bool, dtype: torch.dtype = torch.float32,
              device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(a [M, K] or gate_up [M, 2K], weight [N, K]) with projection-like magnitudes."""
    generator = torch.Generator().manual_seed(m * 7919 + n * 31 + k)
    a = torch.randn(m, 2 * k if silu else k, generator=generator)
    weight = torch.randn(n, k, generator=generator) / k**0.5
    return a.to(dtype).to(device), weight.to(dtype).to(device)


def _linear(a: torch.Tensor, weight: torch.Tensor, silu: bool) -> torch.Tensor:
    """What the projection computes without split-K: silu_and_mul's SwiGLU (silu: a is gate_up), then F.linear."""
    return F.linear(swiglu_ref(a) if silu else a, weight)


def test_the_plan_table_takes_qwen3s_narrow_projections_only() -> None:
    o_plan, down_plan = splitk_plan(256, *QWEN3_O), splitk_plan(256, *QWEN3_DOWN)
    assert o_plan is not None and down_plan is not None
    assert (o_plan.splits, down_plan.splits) == (4, 8)  # K <= 2,048: 4 splits, longer K: 8
    assert (o_plan.block_m, o_plan.block_n, o_plan.block_k) == (64, 64, 128)
    assert splitk_plan(1, *QWEN3_O) == splitk_plan(512, *QWEN3_O) == o_plan
    assert splitk_plan(513, *QWEN3_O) is None  # prefill-sized
    assert splitk_plan(0, *QWEN3_O) is None
    assert splitk_plan(256, 4096, 14336) is None  # Llama-3.1-8B's down_proj: N > 2,048
    assert splitk_plan(256, 2048, 2048) is None  # K < 2 N: qkv-like shapes keep cuBLAS
    assert splitk_plan(256, 1000, 2048) is None and splitk_plan(256, 1024, 2064) is not None
    assert splitk_plan(256, 1024, 2050) is None  # K not a multiple of 16


def test_the_reference_sums_to_the_linear_in_split_order() -> None:
    a, weight = _operands(6, 48, 200, silu=True)
    sums = splitk_linear_ref(a, weight, silu=True, plan=_plan(4))
    assert sums.partials.shape == (4, 6, 48) and (sums.num_rows, sums.num_cols) == (6, 48)
    manual = sums.partials[0] + sums.partials[1] + sums.partials[2] + sums.partials[3]  # left to right
    assert torch.equal(sums.total(), manual)
    torch.testing.assert_close(sums.total(), _linear(a, weight, silu=True), rtol=1e-5, atol=1e-5)
    half = PartialSums(sums.partials, torch.float16)
    assert torch.equal(half.total(), manual.to(torch.float16))  # one rounding, after the float32 sum


def test_swiglu_ref_rounds_like_silu_and_mul() -> None:
    gate_up = torch.randn(4, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(swiglu_ref(gate_up), F.silu(gate) * up)


@pytest.mark.skipif(not INTERPRET, reason="needs Triton's interpreter: TRITON_INTERPRET=1")
@pytest.mark.parametrize("silu", [False, True], ids=["plain", "swiglu"])
@pytest.mark.parametrize("splits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("shape", RAGGED, ids=lambda s: "x".join(map(str, s)))
def test_interpreted_partials_equal_the_reference(shape: tuple[int, int, int], splits: int, silu: bool) -> None:
    m, n, k = shape
    a, weight = _operands(m, n, k, silu)
    plan = _plan(splits)
    got, want = splitk_linear(a, weight, silu, plan), splitk_linear_ref(a, weight, silu, plan)
    assert got.dtype == want.dtype == torch.float32 and got.partials.shape == want.partials.shape
    assert got.partials.shape[0] <= splits  # fewer where K has fewer BLOCK_K steps than splits
    torch.testing.assert_close(got.partials, want.partials, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.total(), _linear(a, weight, silu), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not INTERPRET, reason="needs Triton's interpreter: TRITON_INTERPRET=1")
@pytest.mark.parametrize("silu", [False, True], ids=["plain", "swiglu"])
def test_interpreted_fp16_rounds_the_swiglu_as_the_reference(silu: bool) -> None:
    """fp16 (the interpreter rounds its casts right, unlike bf16): the SwiGLU's two roundings to the dtype matter
    here, where float32 makes them no-ops; a rare silu may still round the other way (exp's last float32 bit)."""
    a, weight = _operands(37, 80, 272, silu, torch.float16)
    plan = _plan(4)
    got, want = splitk_linear(a, weight, silu, plan), splitk_linear_ref(a, weight, silu, plan)
    assert got.dtype == torch.float16 and got.partials.dtype == torch.float32
    torch.testing.assert_close(got.partials, want.partials, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not INTERPRET, reason="needs Triton's interpreter: TRITON_INTERPRET=1")
@pytest.mark.parametrize("silu", [False, True], ids=["plain", "swiglu"])
@pytest.mark.parametrize("splits", [1, 4, 8])
def test_interpreted_partials_in_the_norm_equal_linear_then_add_rms_norm(splits: int, silu: bool) -> None:
    m, n, k = 9, 96, 320  # a ragged M tile, three N tiles, ragged K
    a, weight = _operands(m, n, k, silu)
    generator = torch.Generator().manual_seed(splits)
    residual, norm_weight = torch.randn(m, n, generator=generator), torch.rand(n, generator=generator) + 0.5
    got = add_rms_norm_partials(splitk_linear(a, weight, silu, _plan(splits)), residual, norm_weight, EPS)
    want = add_rms_norm_ref(_linear(a, weight, silu), residual, norm_weight, EPS)
    for out, ref in zip(got, want, strict=True):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not INTERPRET, reason="needs Triton's interpreter: TRITON_INTERPRET=1")
def test_interpreted_no_rows() -> None:
    a, weight = _operands(1, 32, 64, silu=False)
    sums = splitk_linear(a[:0], weight, False, _plan(2))
    assert sums.partials.shape == (2, 0, 32) and sums.total().shape == (0, 32)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA and Triton")
@pytest.mark.parametrize("silu", [False, True], ids=["o_proj", "down_proj"])
@pytest.mark.parametrize("rows", [1, 16, 100, 256, 512])
def test_gpu_bf16_within_rounding_of_f_linear(rows: int, silu: bool) -> None:
    n, k = QWEN3_DOWN if silu else QWEN3_O
    a, weight = _operands(rows, n, k, silu, torch.bfloat16, "cuda")
    plan = splitk_plan(rows, n, k)
    assert plan is not None
    sums = splitk_linear(a, weight, silu, plan)
    want = _linear(a, weight, silu)  # cuBLAS, bf16 out
    torch.testing.assert_close(sums.total(), want, rtol=2e-2, atol=2e-2)  # an output may move a bf16 ulp or two
    torch.testing.assert_close(sums.partials, splitk_linear_ref(a, weight, silu, plan).partials, rtol=1e-3, atol=1e-3)
    residual = torch.randn(rows, n, device="cuda").to(torch.bfloat16)
    norm_weight = (torch.rand(n, device="cuda") + 0.5).to(torch.bfloat16)
    got = add_rms_norm_partials(sums, residual, norm_weight, EPS)
    assert all(torch.equal(g, w) for g, w in zip(got, add_rms_norm(sums.total(), residual, norm_weight, EPS)))
    for out, ref in zip(got, add_rms_norm(want, residual, norm_weight, EPS), strict=True):
        torch.testing.assert_close(out, ref, rtol=5e-2, atol=5e-2)
