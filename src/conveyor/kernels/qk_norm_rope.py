"""Qwen3's per-head q/k RMSNorm and rotary embedding in one launch, in place.

The model: Qwen3 normalizes every head row of q [T, H, d] and k [T, kvh, d] over d (weights [d] shared by
the heads of q, another for k), then rotates it (rotate_half convention, cos/sin [T, d] per token).
Unfused that is three launches per layer: rms_norm.py's kernel for q, again for k, rotary.py's for
both. Here one program per (token, head row) -- q's heads first, then k's -- computes the row's
float32 statistic with rms_norm.py's helper over the whole row (the same block and warp count, so the
same reduction order), scales and rounds to the dtype, times the weight and rounds again (what the
norm kernel stores), then rotates the two halves with rotary.py's helper (its rounding steps) and
writes the row back in place. The result equals the two kernels in sequence bit for bit.
"""

import torch

from conveyor.kernels.rms_norm import inv_rms, rms_norm_ref, row_launch, scale_row
from conveyor.kernels.rotary import rotary_ref, rotate_halves
from conveyor.kernels.triton_compat import tl, triton


@triton.jit
def _norm_rope_row(row_ptr, weight_ptr, cos_ptr, sin_ptr, num_cols, eps, HEAD_DIM: tl.constexpr,
                   HALF: tl.constexpr):
    """Normalize and rotate one head row [HEAD_DIM] at row_ptr in place; cos/sin point at its token's [d]."""
    # the whole row loaded and summed exactly as rms_norm.py's kernel does (num_cols == HEAD_DIM, a runtime
    # value there too): the same code gives the same float32 statistic
    cols = tl.arange(0, HEAD_DIM)
    x = tl.load(row_ptr + cols, mask=cols < num_cols, other=0.0)
    inv = inv_rms(x.to(tl.float32), num_cols, eps)
    dims = tl.arange(0, HALF)
    x1 = tl.load(row_ptr + dims).to(tl.float32)
    x2 = tl.load(row_ptr + HALF + dims).to(tl.float32)
    # the norm's output, rounded to the dtype as the norm kernel stores it
    n1 = scale_row(x1, inv, tl.load(weight_ptr + dims), x.dtype).to(x.dtype).to(tl.float32)
    n2 = scale_row(x2, inv, tl.load(weight_ptr + HALF + dims), x.dtype).to(x.dtype).to(tl.float32)
    cos, sin = tl.load(cos_ptr + dims).to(tl.float32), tl.load(sin_ptr + dims).to(tl.float32)
    cos_rot, sin_rot = tl.load(cos_ptr + HALF + dims).to(tl.float32), tl.load(sin_ptr + HALF + dims).to(tl.float32)
    out1, out2 = rotate_halves(n1, n2, cos, sin, cos_rot, sin_rot, x.dtype)
    tl.store(row_ptr + dims, out1)
    tl.store(row_ptr + HALF + dims, out2)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr, stride_q_t, stride_q_h,
                         stride_k_t, stride_k_h, stride_cs, num_q_heads, num_cols, eps,
                         HEAD_DIM: tl.constexpr, HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    cos_ptr += token * stride_cs
    sin_ptr += token * stride_cs
    if head < num_q_heads:
        _norm_rope_row(q_ptr + token * stride_q_t + head * stride_q_h, q_weight_ptr, cos_ptr, sin_ptr, num_cols,
                       eps, HEAD_DIM, HALF)
    else:
        _norm_rope_row(k_ptr + token * stride_k_t + (head - num_q_heads) * stride_k_h, k_weight_ptr, cos_ptr,
                       sin_ptr, num_cols, eps, HEAD_DIM, HALF)


def qk_norm_rope_(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, eps: float) -> None:
    """Normalize (weights [d]) and rotate q [T, H, d] and k [T, kvh, d] in place; cos/sin [T, d]; one dtype."""
    assert q.dim() == 3 and k.dim() == 3 and q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2], "q/k shapes"
    head_dim = q.shape[2]
    assert cos.shape == sin.shape == (q.shape[0], head_dim), f"cos/sin [T, d], got {tuple(cos.shape)}"
    assert q_weight.shape == k_weight.shape == (head_dim,), "weights [d]"
    assert q.dtype == k.dtype == cos.dtype == sin.dtype == q_weight.dtype == k_weight.dtype, "one dtype"
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos.stride(1) == 1 and sin.stride() == cos.stride()
    assert q_weight.stride(0) == 1 and k_weight.stride(0) == 1, "contiguous weights"
    assert head_dim % 2 == 0 and triton.next_power_of_2(head_dim) == head_dim, "head_dim a power of two"
    if q.shape[0] == 0:
        return
    _, num_warps = row_launch(head_dim)  # rms_norm.py's launch for a row of d: the same reduction order
    _qk_norm_rope_kernel[(q.shape[0], q.shape[1] + k.shape[1])](
        q, k, q_weight, k_weight, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        q.shape[1], head_dim, eps, HEAD_DIM=head_dim, HALF=head_dim // 2, num_warps=num_warps,
    )


def qk_norm_rope_ref(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager torch sequence the kernel fuses: per-head RMSNorm, then rotary, each rounded to the dtype."""
    return (rotary_ref(rms_norm_ref(q, q_weight, eps), cos, sin),
            rotary_ref(rms_norm_ref(k, k_weight, eps), cos, sin))
