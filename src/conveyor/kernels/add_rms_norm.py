"""Residual add + RMSNorm in one launch: s = cast(x + residual), y = rms_norm(s); returns (y, s).

The model (the `fused_add_rms_norm` idea of vLLM): a pre-norm decoder adds each sublayer's output to
the residual stream and normalizes the sum for the next sublayer; eager torch spends one launch on
the add and one on the norm. Here one program per token row loads both rows, adds them in float32 and
rounds the sum to the input dtype -- the single rounding of eager's 16-bit `x + residual` -- stores
that sum as the new residual stream, and normalizes the rounded sum with rms_norm.py's own helpers,
block size and warp count. Both outputs therefore equal the unfused sequence (a torch add, then
`rms_norm`) bit for bit, including rms_norm.py's float32 reduction order.
"""

import torch

from conveyor.kernels.rms_norm import inv_rms, rms_norm_ref, row_launch, scale_row
from conveyor.kernels.triton_compat import tl, triton


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, stride_x, stride_r, num_cols, eps,
                         BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    x = tl.load(x_ptr + token * stride_x + cols, mask=mask, other=0.0)
    residual = tl.load(residual_ptr + token * stride_r + cols, mask=mask, other=0.0)
    # one rounding, like eager's 16-bit add; the norm reads the rounded sum, as eager's norm does
    total = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
    tl.store(sum_ptr + token * num_cols + cols, total, mask=mask)
    x32 = total.to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = scale_row(x32, inv_rms(x32, num_cols, eps), weight, x.dtype).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + token * num_cols + cols, out, mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, H] (rows contiguous, same dtype), weight [H] -> (normed [T, H], x + residual [T, H]),
    both contiguous and new; the inputs are left as they are."""
    assert x.shape == residual.shape and x.dim() == 2 and x.shape[1] == weight.shape[0], "x / residual / weight"
    assert x.dtype == residual.dtype, f"x {x.dtype} residual {residual.dtype}"
    assert x.stride(1) == 1 and residual.stride(1) == 1 and weight.stride(0) == 1, "rows must be contiguous"
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # [T, H]
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)  # [T, H]
    if x.shape[0] > 0:
        block, num_warps = row_launch(x.shape[1])
        _add_rms_norm_kernel[(x.shape[0],)](
            x, residual, weight, out, total, x.stride(0), residual.stride(0), x.shape[1], eps,
            BLOCK=block, num_warps=num_warps,
        )
    return out, total


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager torch sequence the kernel fuses: a 16-bit add, then `rms_norm_ref` of the sum."""
    total = x + residual
    return rms_norm_ref(total, weight, eps), total
