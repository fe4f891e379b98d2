"""Rotary position embedding of q and k in one launch (rotate_half convention).

The model: for each head row x = (x1, x2) over the two halves, out = x * cos + rotate_half(x) * sin
with rotate_half(x) = (-x2, x1), cos/sin [T, d] given per token. The grid: one program per token (already
so before 2026-12-07's look at it; a token's 40 x 128 rows at Llama-3.1-8B are a fair block, and 55
decode tokens a program each); it loads all of its q and k head rows as [HEADS_PAD, d/2] blocks and its
cos/sin once, before any store. Products and sum follow the eager torch expression's rounding steps, but
the compiler may contract them into an FMA, so an element can differ from eager by one bf16 ulp. Eager torch needs ten launches
per layer (five for q, five for k).

The K/V store (optional, STORE_KV; qk_norm_rope.py shares it): given value, the caches and slot_mapping, the
program also loads its V row and slot with the other loads, and after q and k stores the rotated k and v into
the paged cache through store_kv.py's `store_kv_rows` (`store_token_kv`): the bytes `store_kv` writes, FP8
saturation included, and nothing for a negative (CUDA-graph padding) slot. The model then skips `write_kv`,
one launch fewer a layer (model/llama.py's `stores_kv_in_rope` decides). `rotary_store_kv_ref` is the truth.
"""

import torch

from conveyor.kernels.fp8_kv import UNIT_KV_SCALES, KVScales
from conveyor.kernels.store_kv import kv_store_args, store_kv_ref, store_kv_rows
from conveyor.kernels.triton_compat import tl, triton


@triton.jit
def load_halves(ptr, stride_h, NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr):
    """A token's head rows at ptr -> their halves x1, x2 [HEADS_PAD, HALF] (zeros past NUM_HEADS)."""
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HALF)[None, :]
    base = ptr + heads * stride_h + dims
    mask = heads < NUM_HEADS
    return tl.load(base, mask=mask, other=0.0), tl.load(base + HALF, mask=mask, other=0.0)


@triton.jit
def store_halves(ptr, stride_h, x1, x2, NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr):
    """x1, x2 [HEADS_PAD, HALF] -> the first NUM_HEADS head rows at ptr."""
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HALF)[None, :]
    base = ptr + heads * stride_h + dims
    mask = heads < NUM_HEADS
    tl.store(base, x1, mask=mask)
    tl.store(base + HALF, x2, mask=mask)


@triton.jit
def load_cos_sin(cos_ptr, sin_ptr, offset, HALF: tl.constexpr):
    """A token's cos/sin row [d] at offset -> float32 halves (cos, sin, cos_rot, sin_rot), [1, HALF] each."""
    cs = offset + tl.arange(0, HALF)[None, :]
    cos, sin = tl.load(cos_ptr + cs).to(tl.float32), tl.load(sin_ptr + cs).to(tl.float32)
    return cos, sin, tl.load(cos_ptr + HALF + cs).to(tl.float32), tl.load(sin_ptr + HALF + cs).to(tl.float32)


@triton.jit
def rotate_halves(x1, x2, cos, sin, cos_rot, sin_rot, dtype):
    """Float32 halves (x1, x2) of head rows -> the rotated halves in `dtype`; qk_norm_rope.py calls this
    same code so that its rounding steps are this kernel's."""
    # out1 = x1*cos1 + (-x2)*sin1 ; out2 = x2*cos2 + x1*sin2, each product rounded like eager torch
    out1 = ((x1 * cos).to(dtype).to(tl.float32) + (-x2 * sin).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((x2 * cos_rot).to(dtype).to(tl.float32) + (x1 * sin_rot).to(dtype).to(tl.float32)).to(dtype)
    return out1, out2


@triton.jit
def load_token_kv(value_ptr, slot_ptr, token, stride_v_t, stride_v_h, NUM_K_HEADS: tl.constexpr,
                  K_PAD: tl.constexpr, HALF: tl.constexpr):
    """A token's V rows -> halves v1, v2 [K_PAD, HALF], and its cache slot (int64; < 0: padding)."""
    v1, v2 = load_halves(value_ptr + token * stride_v_t, stride_v_h, NUM_K_HEADS, K_PAD, HALF)
    return v1, v2, tl.load(slot_ptr + token).to(tl.int64)


@triton.jit
def store_token_kv(k1, k2, v1, v2, slot, key_cache_ptr, value_cache_ptr, k_scale, v_scale, stride_kc_b,
                   stride_kc_s, stride_kc_h, stride_vc_b, stride_vc_s, stride_vc_h, NUM_K_HEADS: tl.constexpr,
                   K_PAD: tl.constexpr, HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr, KV_FP8: tl.constexpr,
                   FP8_MAX: tl.constexpr):
    """Halves [K_PAD, HALF] of a token's rotated K and its V -> the caches [nb, BLOCK_SIZE, kvh, d] at `slot`
    through store_kv.py's `store_kv_rows` (its bits); a negative slot (CUDA-graph padding) stores nothing."""
    heads = tl.arange(0, K_PAD)[:, None]
    dims = tl.arange(0, HALF)[None, :]
    if slot >= 0:
        block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
        k_dst = key_cache_ptr + block * stride_kc_b + offset * stride_kc_s + heads * stride_kc_h + dims
        v_dst = value_cache_ptr + block * stride_vc_b + offset * stride_vc_s + heads * stride_vc_h + dims
        mask = heads < NUM_K_HEADS
        store_kv_rows(k1, v1, k_dst, v_dst, mask, k_scale, v_scale, KV_FP8, FP8_MAX)
        store_kv_rows(k2, v2, k_dst + HALF, v_dst + HALF, mask, k_scale, v_scale, KV_FP8, FP8_MAX)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_cs,
                   value_ptr, slot_ptr, key_cache_ptr, value_cache_ptr, k_scale, v_scale, stride_v_t, stride_v_h,
                   stride_kc_b, stride_kc_s, stride_kc_h, stride_vc_b, stride_vc_s, stride_vc_h,
                   NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, Q_PAD: tl.constexpr, K_PAD: tl.constexpr,
                   HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr, KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
                   STORE_KV: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    # every load of the token before any store (a store to q may alias k for all the compiler knows,
    # so k's loads would otherwise wait behind it): one HBM round trip a program, not two
    q1, q2 = load_halves(q_ptr + token * stride_q_t, stride_q_h, NUM_Q_HEADS, Q_PAD, HALF)  # [Q_PAD, HALF] each
    k1, k2 = load_halves(k_ptr + token * stride_k_t, stride_k_h, NUM_K_HEADS, K_PAD, HALF)  # [K_PAD, HALF] each
    cos, sin, cos_rot, sin_rot = load_cos_sin(cos_ptr, sin_ptr, token * stride_cs, HALF)
    if STORE_KV:  # V and the slot too, with the other loads
        v1, v2, slot = load_token_kv(value_ptr, slot_ptr, token, stride_v_t, stride_v_h, NUM_K_HEADS, K_PAD, HALF)
    q1, q2 = rotate_halves(q1.to(tl.float32), q2.to(tl.float32), cos, sin, cos_rot, sin_rot, q1.dtype)
    k1, k2 = rotate_halves(k1.to(tl.float32), k2.to(tl.float32), cos, sin, cos_rot, sin_rot, k1.dtype)
    store_halves(q_ptr + token * stride_q_t, stride_q_h, q1, q2, NUM_Q_HEADS, Q_PAD, HALF)
    store_halves(k_ptr + token * stride_k_t, stride_k_h, k1, k2, NUM_K_HEADS, K_PAD, HALF)
    if STORE_KV:
        store_token_kv(k1, k2, v1, v2, slot, key_cache_ptr, value_cache_ptr, k_scale, v_scale, stride_kc_b,
                       stride_kc_s, stride_kc_h, stride_vc_b, stride_vc_s, stride_vc_h, NUM_K_HEADS, K_PAD, HALF,
                       BLOCK_SIZE, KV_FP8, FP8_MAX)


def token_warps(rows: int, head_dim: int) -> int:
    """Warps for a program that holds `rows` (padded) head rows of `head_dim` at once: 4 up to 4,096
    elements (32 a thread, e.g. Qwen3-0.6B's 16 + 8 rows of 128), 8 above (Llama-3.1-8B's 32 + 8), so that
    the float32 halves stay in registers."""
    return 4 if rows * head_dim <= 4096 else 8


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
            value: torch.Tensor | None = None, key_cache: torch.Tensor | None = None,
            value_cache: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None,
            kv_scales: KVScales = UNIT_KV_SCALES) -> None:
    """Rotate q [T, H, d] and k [T, kvh, d] in place; cos/sin [T, d] in the same dtype. Given value [T, kvh, d],
    the caches [num_blocks, block_size, kvh, d] and slot_mapping [T], also store the rotated k and value
    there as `store_kv(k, value, key_cache, value_cache, slot_mapping, scales=kv_scales)` would."""
    assert q.dim() == 3 and k.dim() == 3 and q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2], "q/k shapes"
    assert cos.shape == sin.shape == (q.shape[0], q.shape[2]), f"cos/sin [T, d], got {tuple(cos.shape)}"
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos.stride(1) == 1 and sin.stride() == cos.stride()
    assert q.dtype == k.dtype == cos.dtype == sin.dtype, "q, k, cos, sin must share a dtype"
    head_dim = q.shape[2]
    assert head_dim % 2 == 0 and triton.next_power_of_2(head_dim) == head_dim, "head_dim a power of two"
    kv_args, kv_constants = kv_store_args(k, value, key_cache, value_cache, slot_mapping, kv_scales)
    if q.shape[0] == 0:
        return
    q_pad, k_pad = triton.next_power_of_2(q.shape[1]), triton.next_power_of_2(k.shape[1])
    _rotary_kernel[(q.shape[0],)](
        q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), *kv_args,
        NUM_Q_HEADS=q.shape[1], NUM_K_HEADS=k.shape[1], Q_PAD=q_pad, K_PAD=k_pad, HALF=head_dim // 2,
        num_warps=token_warps(q_pad + k_pad, head_dim), **kv_constants,
    )


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Eager torch: x [T, heads, d] -> x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rotary_store_kv_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, value: torch.Tensor,
                        key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        kv_scales: KVScales = UNIT_KV_SCALES) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary_` with the K/V store, in torch: the rotated (q, k), after `store_kv_ref` of k and value."""
    q, k = rotary_ref(q, cos, sin), rotary_ref(k, cos, sin)
    store_kv_ref(k, value, key_cache, value_cache, slot_mapping, scales=kv_scales)
    return q, k
