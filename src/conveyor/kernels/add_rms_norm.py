"""Residual add + RMSNorm in one launch: s = cast(x + residual), y = rms_norm(s); returns (y, s).

The model (the `fused_add_rms_norm` idea of vLLM): a pre-norm decoder adds each sublayer's output to
the residual stream and normalizes the sum for the next sublayer; eager torch spends one launch on
the add and one on the norm. Here one program per token row loads both rows, adds them in float32 and
rounds the sum to the input dtype -- the single rounding of eager's 16-bit `x + residual` -- stores
that sum as the new residual stream, and normalizes the rounded sum with rms_norm.py's own helpers,
block size and warp count. Both outputs therefore equal the unfused sequence (a torch add, then
`rms_norm`) bit for bit, including rms_norm.py's float32 reduction order.

`add_rms_norm_partials` takes x as kernels/splitk_linear.py's `PartialSums` instead: each program first adds
its row's S float32 partials in split order and rounds the sum to the dtype (the projection's 16-bit output,
as cuBLAS would round it), then runs exactly the add and norm above; the split-K GEMM needs no reduce launch.
"""

import torch

from conveyor.kernels.rms_norm import inv_rms, rms_norm_ref, row_launch, scale_row
from conveyor.kernels.splitk_linear import PartialSums
from conveyor.kernels.triton_compat import tl, triton


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, stride_x, stride_r, num_cols, eps,
                         stride_split, num_splits, PARTIALS: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    if PARTIALS:  # x is [S, T, H] float32 split-K partials: added in split order, rounded as cuBLAS's output
        x_row = x_ptr + token * stride_x + cols
        x32 = tl.zeros((BLOCK,), dtype=tl.float32)
        for _ in range(num_splits):
            x32 += tl.load(x_row, mask=mask, other=0.0)
            x_row += stride_split
        x = x32.to(residual_ptr.dtype.element_ty)
    else:
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
    assert x.shape == residual.shape and x.dim() == 2, f"x {tuple(x.shape)} residual {tuple(residual.shape)}"
    assert x.dtype == residual.dtype, f"x {x.dtype} residual {residual.dtype}"
    assert x.stride(1) == 1, "rows must be contiguous"
    return _launch(x, x.stride(0), residual, weight, eps)


def add_rms_norm_partials(x: PartialSums, residual: torch.Tensor, weight: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm` of x.total() [T, H] (kernels/splitk_linear.py), the partials added in this launch."""
    assert (x.num_rows, x.num_cols) == residual.shape, f"x {tuple(x.partials.shape)} residual {tuple(residual.shape)}"
    assert x.dtype == residual.dtype and x.partials.is_contiguous(), f"x {x.dtype} residual {residual.dtype}"
    splits = (x.partials.shape[0], x.partials.stride(0))  # S, and the elements from one [T, H] slice to the next
    return _launch(x.partials, x.num_cols, residual, weight, eps, splits)


def _launch(x: torch.Tensor, stride_x: int, residual: torch.Tensor, weight: torch.Tensor, eps: float,
            splits: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, H] rows, or with splits = (S, split stride) the [S, T, H] float32 partials of the rows."""
    num_rows, num_cols = residual.shape
    num_splits, stride_split = splits or (1, 0)
    assert residual.dim() == 2 and num_cols == weight.shape[0], "residual / weight"
    assert residual.stride(1) == 1 and weight.stride(0) == 1, "rows must be contiguous"
    total = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)  # [T, H]
    out = torch.empty(residual.shape, dtype=torch.promote_types(residual.dtype, weight.dtype),
                      device=residual.device)  # [T, H]
    if num_rows > 0:
        block, num_warps = row_launch(num_cols)
        _add_rms_norm_kernel[(num_rows,)](
            x, residual, weight, out, total, stride_x, residual.stride(0), num_cols, eps, stride_split, num_splits,
            PARTIALS=splits is not None, BLOCK=block, num_warps=num_warps,
        )
    return out, total


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager torch sequence the kernel fuses: a 16-bit add, then `rms_norm_ref` of the sum."""
    total = x + residual
    return rms_norm_ref(total, weight, eps), total


def add_rms_norm_partials_ref(x: PartialSums, residual: torch.Tensor, weight: torch.Tensor,
                              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm_ref` of the projection's rounded output x.total()."""
    return add_rms_norm_ref(x.total(), residual, weight, eps)
