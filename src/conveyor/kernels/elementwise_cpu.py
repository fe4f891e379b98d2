"""RMSNorm, rotary embedding and SiLU-and-mul on the CPU in one pass each (kernels/cpu/elementwise.c).

The model: the elementwise chain around a decoder layer's matmuls is a dozen tiny torch ops per
layer in eager mode (RMSNorm alone is eight: cast, pow, mean, add, rsqrt, mul, cast, mul), each a
dispatch, an allocation and a pass over the tensor; at decode sizes the dispatches are the cost.
Each wrapper here checks its inputs and runs one C loop; `*_ref` are the eager torch formulas
(transformers' numerics) the tests compare against. float32 CPU tensors only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from conveyor.kernels.cpu_build import cpu_kernels


def _check_rows(x: torch.Tensor) -> None:
    assert x.dtype == torch.float32 and x.device.type == "cpu", f"{x.dtype} on {x.device}"
    assert x.dim() == 2 and x.stride(1) == 1, f"x {tuple(x.shape)} strides {x.stride()}: rows must be contiguous"


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] (rows may be strided) -> contiguous [T, H] = weight * x / sqrt(mean(x^2) + eps)."""
    _check_rows(x)
    assert weight.shape == (x.shape[1],) and weight.dtype == torch.float32 and weight.is_contiguous()
    out = torch.empty(x.shape, dtype=torch.float32)
    cpu_kernels().rms_norm(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), weight.data_ptr(), eps,
                           out.data_ptr(), torch.get_num_threads())
    return out


def rotary_cpu_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate x [T, heads, d] in place (heads contiguous, tokens strided) by cos/sin [T, d]."""
    assert x.dtype == cos.dtype == sin.dtype == torch.float32 and x.device.type == "cpu"
    num_tokens, num_heads, head_dim = x.shape
    assert x.stride(2) == 1 and x.stride(1) == head_dim and head_dim % 2 == 0, f"x strides {x.stride()}"
    assert cos.shape == sin.shape == (num_tokens, head_dim) and cos.is_contiguous() and sin.is_contiguous()
    cpu_kernels().rotary_(x.data_ptr(), num_tokens, num_heads, head_dim, x.stride(0), cos.data_ptr(),
                          sin.data_ptr(), torch.get_num_threads())


def silu_and_mul_cpu(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] contiguous -> [T, I] = silu(gate) * up."""
    _check_rows(gate_up)
    assert gate_up.is_contiguous() and gate_up.shape[1] % 2 == 0
    inner = gate_up.shape[1] // 2
    out = torch.empty((gate_up.shape[0], inner), dtype=torch.float32)
    cpu_kernels().silu_and_mul(gate_up.data_ptr(), gate_up.shape[0], inner, out.data_ptr(), torch.get_num_threads())
    return out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
