"""FP8 weights (--quantization fp8): vLLM's online dynamic quantization of a 16-bit checkpoint.

The model: at load every decoder projection's weight W [N, K] becomes `fp8(W / s_w)` (e4m3) with one
per-tensor scale s_w = max|W| / 448, so it takes one byte per element; embeddings, norms and the LM
head keep the model's dtype (as vLLM's Fp8LinearMethod leaves them). Each forward quantizes its input
the same way, per tensor and dynamically (s_x = max|x| / 448, computed on the device: no host sync,
CUDA-graph capturable), and one `torch._scaled_mm` computes (x_q @ W_q^T) * s_x * s_w (+ bias) in the
input's dtype, accumulating in float32. The torch reference does the same in float32 from the
dequantized operands.
"""

from __future__ import annotations

import torch

FP8_WEIGHT_DTYPE = torch.float8_e4m3fn
"""vLLM's --quantization fp8 element type."""
_FP8_MAX = torch.finfo(FP8_WEIGHT_DTYPE).max
_MIN_SCALE = 1.0 / (_FP8_MAX * 512.0)
"""Floor of a dynamic scale (vLLM's): an all-zero input must not divide by zero."""


def dynamic_scale(x: torch.Tensor) -> torch.Tensor:
    """Per-tensor scale [] float32: max|x| / 448, floored."""
    return (x.abs().amax().float() / _FP8_MAX).clamp_(min=_MIN_SCALE)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..] -> fp8 [..]: x / scale saturated to +-448, rounded to nearest even."""
    return (x.float() / scale).clamp_(-_FP8_MAX, _FP8_MAX).to(FP8_WEIGHT_DTYPE)


def quantize_weight_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] (16/32-bit) -> (fp8 weight [N, K], its per-tensor scale [] float32)."""
    assert weight.dim() == 2, f"weight [N, K], got {tuple(weight.shape)}"
    scale = dynamic_scale(weight)
    return quantize_fp8(weight, scale), scale


def _check_inputs(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> None:
    assert x.dim() == 2 and weight.dim() == 2, f"x [T, K], weight [N, K]: {tuple(x.shape)} {tuple(weight.shape)}"
    assert x.shape[1] == weight.shape[1], f"K: x has {x.shape[1]}, weight {weight.shape[1]}"
    assert weight.dtype == FP8_WEIGHT_DTYPE, f"weight must be {FP8_WEIGHT_DTYPE}, got {weight.dtype}"
    assert weight_scale.numel() == 1 and weight_scale.dtype == torch.float32, "weight_scale: one float32"


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [T, K] (bf16/fp16) @ fp8 weight [N, K]^T -> [T, N] in x's dtype, x quantized per tensor on the fly."""
    _check_inputs(x, weight, weight_scale)
    x_scale = dynamic_scale(x)
    x_q = quantize_fp8(x, x_scale)  # [T, K]
    # weight.t() is a column-major [K, N] view: the layout _scaled_mm's second operand needs.
    return torch._scaled_mm(x_q, weight.t(), scale_a=x_scale, scale_b=weight_scale.reshape(()), bias=bias,
                            out_dtype=x.dtype)


def fp8_linear_ref(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """float32 reference of `fp8_linear` (same quantized operands), returned in x's dtype."""
    _check_inputs(x, weight, weight_scale)
    x_scale = dynamic_scale(x)
    x_deq = quantize_fp8(x, x_scale).float() * x_scale  # [T, K]
    out = x_deq @ (weight.float() * weight_scale).t()  # [T, N]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
