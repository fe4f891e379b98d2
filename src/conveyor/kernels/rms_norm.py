"""RMSNorm in one launch: y = w * cast(x * rsqrt(mean(x^2) + eps)), float32 statistics.

The model: one program per row (a token, or a token's head for Qwen3's q/k norms) loads the row,
computes the mean square in float32, scales, rounds to the input dtype, then multiplies by the weight
and rounds again -- the rounding sequence of the eager torch RMSNorm (and transformers); only the
float32 summation order differs, so an element may rarely move by one bf16 ulp. Eager torch needs eight launches for the same thing.
"""

import torch

from conveyor.kernels.triton_compat import tl, triton


@triton.jit
def inv_rms(x32, num_cols, eps):
    """[BLOCK] float32 row (zeros past num_cols) -> rsqrt(mean(x^2) + eps); add_rms_norm.py calls
    this same code so that its reduction tree, hence its bits, match this kernel's."""
    mean_square = tl.sum(x32 * x32, 0) / num_cols
    return tl.math.rsqrt(mean_square + eps)


@triton.jit
def scale_row(x32, inv, weight, dtype):
    """cast(x * inv) to the input dtype, then times the weight in float32 (rounded by the caller's store)."""
    normed = (x32 * inv).to(dtype)
    return normed.to(tl.float32) * weight.to(tl.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, weight_ptr, out_ptr, stride_x_t, stride_x_h, stride_out, num_cols, eps,
                     BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    row = token * tl.num_programs(1) + head  # output rows are contiguous
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    x = tl.load(x_ptr + token * stride_x_t + head * stride_x_h + cols, mask=mask, other=0.0)
    x32 = x.to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = scale_row(x32, inv_rms(x32, num_cols, eps), weight, x.dtype).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


def row_launch(num_cols: int) -> tuple[int, int]:
    """(BLOCK, num_warps) of a one-row-per-program launch over `num_cols` columns; the fused kernels
    reuse it because the float32 reduction tree (so the result's bits) depends on both."""
    return triton.next_power_of_2(num_cols), 4 if num_cols <= 2048 else 8


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] or [T, heads, H] (any strides but the last) -> contiguous, same shape and promoted dtype."""
    assert x.shape[-1] == weight.shape[0] and weight.dim() == 1, f"x {tuple(x.shape)} weight {tuple(weight.shape)}"
    assert x.dim() in (2, 3) and x.stride(-1) == 1 and weight.stride(0) == 1, "rows must be contiguous"
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    num_heads, stride_h = (x.shape[1], x.stride(1)) if x.dim() == 3 else (1, 0)
    if x.shape[0] > 0:
        block, num_warps = row_launch(x.shape[-1])
        _rms_norm_kernel[(x.shape[0], num_heads)](
            x, weight, out, x.stride(0), stride_h, x.shape[-1], x.shape[-1], eps, BLOCK=block, num_warps=num_warps,
        )
    return out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The eager torch computation the kernel reproduces."""
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed
