"""FP8 weights (--quantization fp8): vLLM's online dynamic quantization of a 16-bit checkpoint.

The model: at load every decoder projection's weight W [N, K] becomes `fp8(W / s_w)` (e4m3) with one
per-tensor scale s_w = max|W| / 448, so it takes one byte per element; embeddings, norms and the LM
head keep the model's dtype (as vLLM's Fp8LinearMethod leaves them). Each forward quantizes its input
the same way, per tensor and dynamically (s_x = max|x| / 448, computed on the device: no host sync,
CUDA-graph capturable; on a GPU by kernels/fp8_quant.py's two Triton passes, the same bits), and one
`torch._scaled_mm` computes (x_q @ W_q^T) * s_x * s_w (+ bias) in the input's dtype, accumulating in
float32. The torch reference does the same in float32 from the
dequantized operands.

--quantization ptpc_fp8: one scale per output channel ([1, N], `quantize_weight_fp8_per_channel`) and one
per input row, computed in one Triton launch (`fp8_linear_per_token`); a row-wise `_scaled_mm` applies both.
"""

from __future__ import annotations

import torch

from conveyor.kernels.fp8_quant import (
    FP8_DTYPE,
    dynamic_scale,
    quantize_fp8,
    quantize_fp8_dynamic,
    quantize_fp8_per_token,
    quantize_fp8_per_token_ref,
)
from conveyor.kernels.triton_compat import HAS_TRITON

FP8_WEIGHT_DTYPE = FP8_DTYPE
"""vLLM's --quantization fp8 element type."""


def quantize_weight_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] (16/32-bit) -> (fp8 weight [N, K], its per-tensor scale [] float32)."""
    assert weight.dim() == 2, f"weight [N, K], got {tuple(weight.shape)}"
    scale = dynamic_scale(weight)
    return quantize_fp8(weight, scale), scale


def quantize_weight_fp8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] (16/32-bit) -> (fp8 weight [N, K], per-output-channel scales [1, N] float32): the
    row `fp8_linear_per_token` takes (--quantization ptpc_fp8). Row n is quantized as its own tensor."""
    assert weight.dim() == 2, f"weight [N, K], got {tuple(weight.shape)}"
    weight_q, scales = quantize_fp8_per_token_ref(weight)  # [N, K] fp8, [N, 1]: a channel is a weight row
    return weight_q, scales.reshape(1, -1).contiguous()


def _check_inputs(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> None:
    assert x.dim() == 2 and weight.dim() == 2, f"x [T, K], weight [N, K]: {tuple(x.shape)} {tuple(weight.shape)}"
    assert x.shape[1] == weight.shape[1], f"K: x has {x.shape[1]}, weight {weight.shape[1]}"
    assert weight.dtype == FP8_WEIGHT_DTYPE, f"weight must be {FP8_WEIGHT_DTYPE}, got {weight.dtype}"
    assert weight_scale.numel() == 1 and weight_scale.dtype == torch.float32, "weight_scale: one float32"


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, K] (bf16/fp16) @ fp8 weight [N, K]^T -> [T, N] in x's dtype, x quantized per tensor on the fly,
    or with `input_scale` ([] float32: an FP8 checkpoint's static scale; x / s saturates at +-448)."""
    _check_inputs(x, weight, weight_scale)
    if input_scale is not None:
        x_scale = input_scale.reshape(())
        x_q = quantize_fp8(x, x_scale)  # [T, K]
    elif x.is_cuda and HAS_TRITON:  # two fused passes instead of seven torch kernels (kernels/fp8_quant.py)
        x_q, x_scale = quantize_fp8_dynamic(x)  # [T, K] fp8, [] float32
    else:
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


def per_token_weight_scales(weight_scale: torch.Tensor, num_out: int) -> torch.Tensor:
    """A per-tensor weight scale [] as the [1, N] float32 row a row-wise `_scaled_mm` takes (it refuses a
    broadcast view): made once per weight, not per forward, so a forward adds no copy launch."""
    return weight_scale.reshape(1, 1).expand(1, num_out).contiguous()


def fp8_linear_per_token(
    x: torch.Tensor, weight: torch.Tensor, weight_scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`fp8_linear` with one activation scale per row: x [T, K] (bf16) -> [T, N] (issue 37's lever 4; the
    engine runs `fp8_linear`). `weight_scales` is `per_token_weight_scales`'s [1, N] row.

    One quantization launch on a GPU instead of three, and a row-wise `_scaled_mm`
    (x_q @ W_q^T) * s_x[t] * s_w."""
    _check_per_token(x, weight, weight_scales)
    x_q, x_scales = quantize_fp8_per_token(x) if x.is_cuda and HAS_TRITON else quantize_fp8_per_token_ref(x)
    out = torch._scaled_mm(x_q, weight.t(), scale_a=x_scales, scale_b=weight_scales, out_dtype=x.dtype)
    return out if bias is None else out + bias  # bias apart: row-wise scaling takes none on every build


def fp8_linear_per_token_ref(
    x: torch.Tensor, weight: torch.Tensor, weight_scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """float32 reference of `fp8_linear_per_token` (same quantized operands), returned in x's dtype."""
    _check_per_token(x, weight, weight_scales)
    x_q, x_scales = quantize_fp8_per_token_ref(x)
    out = (x_q.float() * x_scales) @ (weight.float() * weight_scales.t()).t()  # [T, N]; weight_scales.t() [N, 1]
    return (out if bias is None else out + bias.float()).to(x.dtype)


def _check_per_token(x: torch.Tensor, weight: torch.Tensor, weight_scales: torch.Tensor) -> None:
    _check_inputs(x, weight, weight_scales[0, :1])
    assert weight_scales.shape == (1, weight.shape[0]), f"weight_scales [1, N]: {tuple(weight_scales.shape)}"
