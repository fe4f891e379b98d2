"""Dynamic per-tensor FP8 quantization of an activation, in two Triton passes (issue 37).

The model, as kernels/fp8_linear.py's torch path: s = max(max|x| / 448, floor) in float32, then
x_q = e4m3(clamp(x / s, -448, 448)), rounded to nearest even. The torch path runs it as seven kernels
over five full-size temporaries (|x|, the float32 copy, the quotient): ~27 bytes moved per element, per
projection, per step. Here pass 1 reads x once and folds each block's max|x| into one float32 with an
atomic max (max is exact and order-free, so the result is the torch path's); pass 2 reads x again and
writes one byte per element: 5 bytes per element in three launches (the zeroed max included).

Both passes run on the device with no host sync, so CUDA graphs capture them. Divisions are IEEE
round-to-nearest (`div_rn`), as torch's, so the scale and the FP8 bits equal the torch path's.
"""

from __future__ import annotations

import torch

from conveyor.kernels.triton_compat import tl, triton

FP8_DTYPE = torch.float8_e4m3fn
"""vLLM's --quantization fp8 element type, for weights and activations."""
_FP8_MAX = torch.finfo(FP8_DTYPE).max
_MIN_SCALE = 1.0 / (_FP8_MAX * 512.0)
"""Floor of a dynamic scale (vLLM's): an all-zero input must not divide by zero."""
_BLOCK = 4096
"""Elements per program: a [256, 4096] activation is 256 programs, 256 atomics on one word."""


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n, other=0.0).to(tl.float32)  # [BLOCK]
    tl.atomic_max(amax_ptr, tl.max(tl.abs(x), axis=0))  # non-negative floats: max is exact


@triton.jit
def _quantize_kernel(x_ptr, out_ptr, amax_ptr, scale_ptr, n,
                     FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    scale = tl.maximum(tl.math.div_rn(tl.load(amax_ptr), FP8_MAX), MIN_SCALE)  # [] float32
    if tl.program_id(0) == 0:
        tl.store(scale_ptr, scale)
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)  # [BLOCK]
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


def _div_448(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448 rounded once to float32, as the kernels' `div_rn`. On CUDA, torch divides by a Python
    scalar as a multiply by its reciprocal, which is an ulp off in about half the cases (the GPU bit tests
    failed on it); float64 division then one rounding is the correctly rounded float32 quotient."""
    return (amax.double() / _FP8_MAX).float()


def dynamic_scale(x: torch.Tensor) -> torch.Tensor:
    """Per-tensor scale [] float32: max|x| / 448, floored (torch)."""
    if x.numel() == 0:  # amax has no identity on an empty tensor: the floor, as the Triton path gives
        return torch.full((), _MIN_SCALE, dtype=torch.float32, device=x.device)
    return _div_448(x.abs().amax()).clamp_(min=_MIN_SCALE)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..] -> fp8 [..]: x / scale saturated to +-448, rounded to nearest even (torch)."""
    return (x.float() / scale).clamp_(-_FP8_MAX, _FP8_MAX).to(FP8_DTYPE)


def quantize_fp8_dynamic(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..] (16/32-bit, on a Triton device) -> (e4m3 [..] like x, its per-tensor scale [] float32)."""
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), f"x must be 16/32-bit, got {x.dtype}"
    x = x.contiguous()  # flat indexing; a no-op for the projections' inputs
    n = x.numel()
    amax = torch.zeros((), dtype=torch.float32, device=x.device)
    scale = torch.empty((), dtype=torch.float32, device=x.device)
    out = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    if n == 0:
        scale.fill_(_MIN_SCALE)
        return out, scale
    grid = (triton.cdiv(n, _BLOCK),)
    _amax_kernel[grid](x, amax, n, BLOCK=_BLOCK)
    _quantize_kernel[grid](x, out, amax, scale, n, FP8_MAX=_FP8_MAX, MIN_SCALE=_MIN_SCALE, BLOCK=_BLOCK)
    return out, scale


def quantize_fp8_dynamic_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch `quantize_fp8_dynamic` (the path of devices without Triton)."""
    scale = dynamic_scale(x)
    return quantize_fp8(x, scale), scale


# Per-token scales (issue 37's lever 4, beside the per-tensor path the engine runs): one scale per row,
# s_t = max(max|x_t| / 448, floor).
# A row is one program, so the amax and the cast are one launch with no atomic and no zeroed word
# (the per-tensor path is three launches: at decode a projection's input is ~2 MB, so each launch costs
# its latency, ~1-4 us on an H100, not its bytes). `torch._scaled_mm` takes the scales row-wise.
@triton.jit
def _per_token_kernel(x_ptr, out_ptr, scale_ptr, num_cols, stride_x, stride_out,
                      FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], tl.float32)
    for start in range(0, num_cols, BLOCK):  # pass 1 over the row: its max|x|
        x = tl.load(x_ptr + row * stride_x + start + cols, mask=start + cols < num_cols, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), FP8_MAX), MIN_SCALE)  # [] float32
    tl.store(scale_ptr + row, scale)
    for start in range(0, num_cols, BLOCK):  # pass 2: the row again (from L2), one byte out per element
        mask = start + cols < num_cols
        x = tl.load(x_ptr + row * stride_x + start + cols, mask=mask, other=0.0).to(tl.float32)
        y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
        tl.store(out_ptr + row * stride_out + start + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (16/32-bit, on a Triton device) -> (e4m3 [T, K], per-row scales [T, 1] float32)."""
    assert x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16, torch.float32), f"x [T, K]: {x.shape} {x.dtype}"
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return out, scales.fill_(_MIN_SCALE)
    _per_token_kernel[(x.shape[0],)](x, out, scales, x.shape[1], x.stride(0), out.stride(0),
                                     FP8_MAX=_FP8_MAX, MIN_SCALE=_MIN_SCALE, BLOCK=1024)
    return out, scales


def quantize_fp8_per_token_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch `quantize_fp8_per_token`: [T, K] -> (e4m3 [T, K], [T, 1] float32)."""
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device), torch.full(
            (x.shape[0], 1), _MIN_SCALE, dtype=torch.float32, device=x.device)
    scales = _div_448(x.abs().amax(dim=1, keepdim=True)).clamp_(min=_MIN_SCALE)  # [T, 1]
    return quantize_fp8(x, scales), scales
