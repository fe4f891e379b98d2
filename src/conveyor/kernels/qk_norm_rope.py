"""Qwen3's per-head q/k RMSNorm and rotary embedding in one launch, in place.

The model: Qwen3 normalizes every head row of q [T, H, d] and k [T, kvh, d] over d (weights [d] shared by
the heads of q, another for k), then rotates it (rotate_half convention, cos/sin [T, d] per token).
Unfused that is three launches per layer: rms_norm.py's kernel for q, again for k, rotary.py's for both.

The grid: one program per token. It loads all of the token's q and k head rows as two 2D blocks
[HEADS_PAD, d/2] per half (rows past the head count masked), and the token's cos/sin once, before it
stores anything; then, per row, the float32 statistic rsqrt(mean(x^2) + eps) over d, the scaled row
rounded to the dtype, times the weight and rounded again (what the norm kernel stores), rotated with
rotary.py's `rotate_halves` (its rounding steps); then it writes both blocks back in place.

The invariants: the rounding sequence is the eager torch one, `qk_norm_rope_ref` (the truth the tests
hold the kernel to). It is not that reference, nor the unfused kernels, bit for bit: the float32 sum of
squares is reduced in another order, and on a GPU the compiler contracts products into FMAs, which skip
a rounding (the H100 showed both kernels' bf16 rows differing; docs/performance.md, "fused-tests"). An
element may so differ by a bf16 ulp; the GPU tests hold it to the unfused kernels' accuracy.

Optionally (value, the caches, slot_mapping given) the kernel also stores the new k and v into the paged KV
cache as `store_kv` would, rotary.py's `store_token_kv` (see its docstring): the same bytes, one launch fewer
a layer; `qk_norm_rope_store_kv_ref` is its torch sequence.
"""

import torch

from conveyor.kernels.fp8_kv import UNIT_KV_SCALES, KVScales
from conveyor.kernels.rms_norm import rms_norm_ref, scale_row
from conveyor.kernels.rotary import (
    load_cos_sin,
    load_halves,
    load_token_kv,
    rotary_ref,
    rotate_halves,
    store_halves,
    store_token_kv,
    token_warps,
)
from conveyor.kernels.store_kv import kv_store_args, store_kv_ref
from conveyor.kernels.triton_compat import tl, triton


@triton.jit
def _norm_rope_rows(x1, x2, weight_ptr, cos, sin, cos_rot, sin_rot, eps, HEAD_DIM: tl.constexpr,
                    HALF: tl.constexpr):
    """Halves [HEADS_PAD, HALF] of head rows (their dtype) -> normalized and rotated halves, same dtype;
    cos/sin halves [1, HALF] float32, the weight [HEAD_DIM] at weight_ptr."""
    dims = tl.arange(0, HALF)[None, :]
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    mean_square = (tl.sum(a * a, 1) + tl.sum(b * b, 1)) / HEAD_DIM  # [HEADS_PAD]: a statistic per row
    inv = tl.math.rsqrt(mean_square + eps)[:, None]  # [HEADS_PAD, 1]
    # the norm's output, rounded to the dtype as the norm kernel stores it
    n1 = scale_row(a, inv, tl.load(weight_ptr + dims), x1.dtype).to(x1.dtype).to(tl.float32)
    n2 = scale_row(b, inv, tl.load(weight_ptr + HALF + dims), x1.dtype).to(x1.dtype).to(tl.float32)
    return rotate_halves(n1, n2, cos, sin, cos_rot, sin_rot, x1.dtype)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr, stride_q_t, stride_q_h,
                         stride_k_t, stride_k_h, stride_cs, eps, value_ptr, slot_ptr, key_cache_ptr, value_cache_ptr,
                         k_scale, v_scale, stride_v_t, stride_v_h, stride_kc_b, stride_kc_s, stride_kc_h, stride_vc_b,
                         stride_vc_s, stride_vc_h, NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr,
                         Q_PAD: tl.constexpr, K_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
                         STORE_KV: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    q_ptr += token * stride_q_t
    k_ptr += token * stride_k_t
    # every load of the token is issued before any store: one HBM round trip, not one per block
    q1, q2 = load_halves(q_ptr, stride_q_h, NUM_Q_HEADS, Q_PAD, HALF)  # [Q_PAD, HALF] each
    k1, k2 = load_halves(k_ptr, stride_k_h, NUM_K_HEADS, K_PAD, HALF)  # [K_PAD, HALF] each
    cos, sin, cos_rot, sin_rot = load_cos_sin(cos_ptr, sin_ptr, token * stride_cs, HALF)  # once a token
    if STORE_KV:  # V and the slot too, with the other loads
        v1, v2, slot = load_token_kv(value_ptr, slot_ptr, token, stride_v_t, stride_v_h, NUM_K_HEADS, K_PAD, HALF)
    q1, q2 = _norm_rope_rows(q1, q2, q_weight_ptr, cos, sin, cos_rot, sin_rot, eps, HEAD_DIM, HALF)
    k1, k2 = _norm_rope_rows(k1, k2, k_weight_ptr, cos, sin, cos_rot, sin_rot, eps, HEAD_DIM, HALF)
    store_halves(q_ptr, stride_q_h, q1, q2, NUM_Q_HEADS, Q_PAD, HALF)
    store_halves(k_ptr, stride_k_h, k1, k2, NUM_K_HEADS, K_PAD, HALF)
    if STORE_KV:
        store_token_kv(k1, k2, v1, v2, slot, key_cache_ptr, value_cache_ptr, k_scale, v_scale, stride_kc_b,
                       stride_kc_s, stride_kc_h, stride_vc_b, stride_vc_s, stride_vc_h, NUM_K_HEADS, K_PAD, HALF,
                       BLOCK_SIZE, KV_FP8, FP8_MAX)


def qk_norm_rope_(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, eps: float, *, value: torch.Tensor | None = None,
                  key_cache: torch.Tensor | None = None, value_cache: torch.Tensor | None = None,
                  slot_mapping: torch.Tensor | None = None, kv_scales: KVScales = UNIT_KV_SCALES) -> None:
    """Normalize (weights [d]) and rotate q [T, H, d] and k [T, kvh, d] in place; cos/sin [T, d]; one dtype.
    Given value [T, kvh, d], the caches [num_blocks, block_size, kvh, d] and slot_mapping [T], also store the
    new k and value there as `store_kv(k, value, key_cache, value_cache, slot_mapping, scales=kv_scales)`."""
    assert q.dim() == 3 and k.dim() == 3 and q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2], "q/k shapes"
    head_dim = q.shape[2]
    assert cos.shape == sin.shape == (q.shape[0], head_dim), f"cos/sin [T, d], got {tuple(cos.shape)}"
    assert q_weight.shape == k_weight.shape == (head_dim,), "weights [d]"
    assert q.dtype == k.dtype == cos.dtype == sin.dtype == q_weight.dtype == k_weight.dtype, "one dtype"
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos.stride(1) == 1 and sin.stride() == cos.stride()
    assert q_weight.stride(0) == 1 and k_weight.stride(0) == 1, "contiguous weights"
    assert head_dim % 2 == 0 and triton.next_power_of_2(head_dim) == head_dim, "head_dim a power of two"
    kv_args, kv_constants = kv_store_args(k, value, key_cache, value_cache, slot_mapping, kv_scales)
    if q.shape[0] == 0:
        return
    # One program per token, not per (token, block of heads): at decode batches of 128+ tokens the grid
    # already fills the SMs, and a token's rows (24 x 128 for Qwen3-0.6B) are a small block; at a few
    # tokens the launch is one load round trip either way, and a split would reload cos/sin per block.
    q_pad, k_pad = triton.next_power_of_2(q.shape[1]), triton.next_power_of_2(k.shape[1])
    _qk_norm_rope_kernel[(q.shape[0],)](
        q, k, q_weight, k_weight, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        eps, *kv_args, NUM_Q_HEADS=q.shape[1], NUM_K_HEADS=k.shape[1], Q_PAD=q_pad, K_PAD=k_pad,
        HEAD_DIM=head_dim, HALF=head_dim // 2, num_warps=token_warps(q_pad + k_pad, head_dim), **kv_constants,
    )


def qk_norm_rope_ref(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager torch sequence the kernel fuses: per-head RMSNorm, then rotary, each rounded to the dtype."""
    return (rotary_ref(rms_norm_ref(q, q_weight, eps), cos, sin),
            rotary_ref(rms_norm_ref(k, k_weight, eps), cos, sin))


def qk_norm_rope_store_kv_ref(q: torch.Tensor, k: torch.Tensor, weights: tuple[torch.Tensor, torch.Tensor],
                              rope: tuple[torch.Tensor, torch.Tensor], eps: float, value: torch.Tensor,
                              kv_cache: tuple[torch.Tensor, torch.Tensor], slot_mapping: torch.Tensor,
                              kv_scales: KVScales = UNIT_KV_SCALES) -> tuple[torch.Tensor, torch.Tensor]:
    """`qk_norm_rope_` with the K/V store, in torch: (q, k) of `qk_norm_rope_ref`, after `store_kv_ref` of that
    k and value into kv_cache = (key_cache, value_cache)."""
    q, k = qk_norm_rope_ref(q, k, *weights, *rope, eps)
    store_kv_ref(k, value, *kv_cache, slot_mapping, scales=kv_scales)
    return q, k
