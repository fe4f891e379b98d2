"""Rotary position embedding of q and k in one launch (rotate_half convention).

The model: one program per token rotates all its query and key heads: for each head row x = (x1, x2)
over the two halves, out = x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2, x1), cos/sin
[T, d] given per token. Products and sum follow the eager torch expression's rounding steps, but
the compiler may contract them into an FMA, so an element can differ from eager by one bf16 ulp. Eager torch needs ten launches
per layer (five for q, five for k).
"""

import torch

from conveyor.kernels.triton_compat import tl, triton


@triton.jit
def _rotate_rows(ptr, stride_t, stride_h, token, cos, sin, cos_rot, sin_rot,
                 NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr):
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HALF)[None, :]
    mask = heads < NUM_HEADS
    base = ptr + token * stride_t + heads * stride_h
    x1 = tl.load(base + dims, mask=mask, other=0.0)
    x2 = tl.load(base + HALF + dims, mask=mask, other=0.0)
    out1, out2 = rotate_halves(x1.to(tl.float32), x2.to(tl.float32), cos, sin, cos_rot, sin_rot, x1.dtype)
    tl.store(base + dims, out1, mask=mask)
    tl.store(base + HALF + dims, out2, mask=mask)


@triton.jit
def rotate_halves(x1, x2, cos, sin, cos_rot, sin_rot, dtype):
    """Float32 halves (x1, x2) of head rows -> the rotated halves in `dtype`; qk_norm_rope.py calls this
    same code so that its rounding steps are this kernel's."""
    # out1 = x1*cos1 + (-x2)*sin1 ; out2 = x2*cos2 + x1*sin2, each product rounded like eager torch
    out1 = ((x1 * cos).to(dtype).to(tl.float32) + (-x2 * sin).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((x2 * cos_rot).to(dtype).to(tl.float32) + (x1 * sin_rot).to(dtype).to(tl.float32)).to(dtype)
    return out1, out2


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_cs,
                   NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, Q_PAD: tl.constexpr, K_PAD: tl.constexpr,
                   HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, HALF)[None, :]
    cos = tl.load(cos_ptr + token * stride_cs + dims).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_cs + dims).to(tl.float32)
    cos_rot = tl.load(cos_ptr + token * stride_cs + HALF + dims).to(tl.float32)
    sin_rot = tl.load(sin_ptr + token * stride_cs + HALF + dims).to(tl.float32)
    _rotate_rows(q_ptr, stride_q_t, stride_q_h, token, cos, sin, cos_rot, sin_rot, NUM_Q_HEADS, Q_PAD, HALF)
    _rotate_rows(k_ptr, stride_k_t, stride_k_h, token, cos, sin, cos_rot, sin_rot, NUM_K_HEADS, K_PAD, HALF)


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q [T, H, d] and k [T, kvh, d] in place; cos/sin [T, d] in the same dtype."""
    assert q.dim() == 3 and k.dim() == 3 and q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2], "q/k shapes"
    assert cos.shape == sin.shape == (q.shape[0], q.shape[2]), f"cos/sin [T, d], got {tuple(cos.shape)}"
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos.stride(1) == 1 and sin.stride() == cos.stride()
    assert q.dtype == k.dtype == cos.dtype == sin.dtype, "q, k, cos, sin must share a dtype"
    head_dim = q.shape[2]
    assert head_dim % 2 == 0 and triton.next_power_of_2(head_dim) == head_dim, "head_dim a power of two"
    if q.shape[0] == 0:
        return
    _rotary_kernel[(q.shape[0],)](
        q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        NUM_Q_HEADS=q.shape[1], NUM_K_HEADS=k.shape[1], Q_PAD=triton.next_power_of_2(q.shape[1]),
        K_PAD=triton.next_power_of_2(k.shape[1]), HALF=head_dim // 2, num_warps=4,
    )


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Eager torch: x [T, heads, d] -> x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
