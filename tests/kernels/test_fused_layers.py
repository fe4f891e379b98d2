"""Fused RMSNorm / rotary / SiLU-and-mul: references equal the eager layers (CPU); kernels are within
one bf16 rounding of the references (GPU); the rotary kernel equals its reference under Triton's
interpreter (TRITON_INTERPRET=1 with triton importable; see test_qk_norm_rope.py) in float32 and fp16,
whose casts the interpreter rounds as the GPU does (bf16 it truncates)."""

from __future__ import annotations

import os

import pytest
import torch

from conveyor.kernels.rms_norm import rms_norm, rms_norm_ref
from conveyor.kernels.rotary import rotary_, rotary_ref
from conveyor.kernels.silu_and_mul import silu_and_mul, silu_and_mul_ref
from conveyor.kernels.triton_compat import HAS_TRITON

gpu = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and Triton")
interpreted = pytest.mark.skipif(not HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="needs Triton's interpreter: TRITON_INTERPRET=1")


def test_references_match_the_eager_layers() -> None:
    layers = pytest.importorskip("conveyor.model.layers")
    x = torch.randn(5, 3, 64)
    norm = layers.RMSNorm(64, 1e-6)
    norm.weight.data = torch.randn(64)
    # on CPU in float32 the layer runs the C loop (kernels/elementwise_cpu.py): float32 summation order
    torch.testing.assert_close(rms_norm_ref(x, norm.weight, 1e-6), norm(x), atol=1e-6, rtol=1e-6)
    cos, sin = torch.randn(5, 64), torch.randn(5, 64)
    assert torch.equal(rotary_ref(x, cos, sin), layers.apply_rotary(x, cos, sin))
    gate_up = torch.randn(5, 32)
    assert torch.equal(silu_and_mul_ref(gate_up), torch.nn.functional.silu(gate_up[:, :16]) * gate_up[:, 16:])


def _ulp_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal, or off by one bf16 rounding on a tiny fraction of elements (reduction order)."""
    differs = out != ref
    assert differs.float().mean() < 1e-3
    assert torch.allclose(out.float(), ref.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("shape", [(7, 1024), (300, 4096), (9, 16, 128)])
def test_rms_norm_kernel(shape: tuple[int, ...]) -> None:
    x = torch.randn(shape, device="cuda").to(torch.bfloat16)
    if len(shape) == 3:  # a strided view, as q out of a fused qkv projection
        x = torch.randn(shape[0], shape[1] + 4, shape[2], device="cuda").to(torch.bfloat16)[:, 2 : 2 + shape[1]]
    weight = torch.randn(shape[-1], device="cuda").to(torch.bfloat16)
    _ulp_close(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6))


def _qkv_rope(num_tokens: int, heads: tuple[int, int], head_dim: int, dtype: torch.dtype, device: str = "cpu",
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qkv [T, (H + 2 kvh) d], q [T, H, d] and k [T, kvh, d] strided views of it, cos, sin [T, d])."""
    qkv = torch.randn(num_tokens, (heads[0] + 2 * heads[1]) * head_dim, device=device).to(dtype)
    q = qkv[:, : heads[0] * head_dim].view(num_tokens, heads[0], head_dim)
    k = qkv[:, heads[0] * head_dim : (heads[0] + heads[1]) * head_dim].view(num_tokens, heads[1], head_dim)
    angles = torch.rand(num_tokens, head_dim // 2, device=device) * 100
    return qkv, q, k, torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 7])
@pytest.mark.parametrize("heads", [(32, 8), (6, 3), (5, 1)])
def test_interpreted_rotary_kernel_equals_the_reference(dtype: torch.dtype, num_tokens: int,
                                                        heads: tuple[int, int]) -> None:
    qkv, q, k, cos, sin = _qkv_rope(num_tokens, heads, 64, dtype)
    q_ref, k_ref = rotary_ref(q, cos, sin), rotary_ref(k, cos, sin)
    v_before = qkv[:, (heads[0] + heads[1]) * 64 :].clone()
    rotary_(q, k, cos, sin)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    assert torch.equal(qkv[:, (heads[0] + heads[1]) * 64 :], v_before)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("heads", [(16, 8), (32, 8), (8, 8)])
def test_rotary_kernel_matches_eager(heads: tuple[int, int]) -> None:
    head_dim = 128
    qkv, q, k, cos, sin = _qkv_rope(37, heads, head_dim, torch.bfloat16, "cuda")
    q_ref, k_ref = rotary_ref(q, cos, sin), rotary_ref(k, cos, sin)
    v_before = qkv[:, (heads[0] + heads[1]) * head_dim :].clone()
    rotary_(q, k, cos, sin)
    for out, ref in ((q, q_ref), (k, k_ref)):  # FMA contraction: at most one bf16 ulp apart
        assert torch.allclose(out.float(), ref.float(), rtol=1.6e-2, atol=1e-2)
    assert torch.equal(qkv[:, (heads[0] + heads[1]) * head_dim :], v_before)


@pytest.mark.gpu
@gpu
def test_silu_and_mul_kernel() -> None:
    gate_up = torch.randn(300, 2 * 3072, device="cuda").to(torch.bfloat16)
    _ulp_close(silu_and_mul(gate_up), silu_and_mul_ref(gate_up))
