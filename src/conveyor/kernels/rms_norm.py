"""RMSNorm in one launch: y = w * cast(x * rsqrt(mean(x^2) + eps)), float32 statistics.

The model: one program per row (a token, or a token's head for Qwen3's q/k norms) loads the row,
computes the mean square in float32, scales, rounds to the input dtype, then multiplies by the weight
and rounds again -- the rounding sequence of the eager torch RMSNorm (and transformers); only the
float32 summation order differs, so an element may rarely move by one bf16 ulp. Eager torch needs eight launches for the same thing.
"""

import torch

from conveyor.kernels.triton_compat import tl, triton


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
    mean_square = tl.sum(x32 * x32, 0) / num_cols
    normed = (x32 * tl.math.rsqrt(mean_square + eps)).to(x.dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = (normed.to(tl.float32) * weight.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] or [T, heads, H] (any strides but the last) -> contiguous, same shape and promoted dtype."""
    assert x.shape[-1] == weight.shape[0] and weight.dim() == 1, f"x {tuple(x.shape)} weight {tuple(weight.shape)}"
    assert x.dim() in (2, 3) and x.stride(-1) == 1 and weight.stride(0) == 1, "rows must be contiguous"
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    num_heads, stride_h = (x.shape[1], x.stride(1)) if x.dim() == 3 else (1, 0)
    if x.shape[0] > 0:
        _rms_norm_kernel[(x.shape[0], num_heads)](
            x, weight, out, x.stride(0), stride_h, x.shape[-1], x.shape[-1], eps,
            BLOCK=triton.next_power_of_2(x.shape[-1]), num_warps=4 if x.shape[-1] <= 2048 else 8,
        )
    return out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The eager torch computation the kernel reproduces."""
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed
