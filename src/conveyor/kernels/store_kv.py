"""Store this step's new K and V into the paged KV cache at their slots.

The model: every scheduled token t has a flat cache slot `slot_mapping[t] = block_id * block_size +
offset`; its K row [num_kv_heads, head_dim] goes to `key_cache[block_id, offset]` and its V row to
`value_cache[block_id, offset]`. One program per token copies all of its heads at once (the grid was
already so at 2026-12-07's look at it: Llama-3.1-8B's 8 x 128 K and V elements a token, 8 a thread in one
16-byte access; it loads them with the slot, before branching on it). A negative
slot means "padding token" (CUDA-graph buckets pad the batch) and is skipped, so padded replays never
touch real blocks. An FP8 cache (--kv-cache-dtype fp8) stores x / scale saturated to the format's
range, as kernels/fp8_kv.py's `quantize_kv` does, so the kernel and the reference write the same bits.

The rope kernels (rotary.py, qk_norm_rope.py) can store the step's K/V themselves, one launch fewer a
layer: `kv_store_args` gives them the arguments and `store_kv_rows` is the store both they and this
kernel run, so the cache bytes are the same whichever launch wrote them.
"""

import torch

from conveyor.kernels.fp8_kv import UNIT_KV_SCALES, KVScales, is_fp8, quantize_kv
from conveyor.kernels.triton_compat import tl, triton


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr, k_scale, v_scale,
    stride_key_t, stride_key_h, stride_value_t, stride_value_h,
    stride_kc_b, stride_kc_s, stride_kc_h, stride_vc_b, stride_vc_s, stride_vc_h,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    # K, V and the slot loaded together, before the branch on the slot: one HBM round trip, not the slot's
    # and then the rows' (a padding token's rows exist too: key/value are [T, kvh, d] over the padded T)
    key = tl.load(key_ptr + token * stride_key_t + heads * stride_key_h + dims, mask=mask)
    value = tl.load(value_ptr + token * stride_value_t + heads * stride_value_h + dims, mask=mask)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token of a CUDA-graph bucket
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    k_dst = key_cache_ptr + block * stride_kc_b + offset * stride_kc_s + heads * stride_kc_h + dims
    v_dst = value_cache_ptr + block * stride_vc_b + offset * stride_vc_s + heads * stride_vc_h + dims
    store_kv_rows(key, value, k_dst, v_dst, mask, k_scale, v_scale, KV_FP8, FP8_MAX)


@triton.jit
def store_kv_rows(key, value, k_dst, v_dst, mask, k_scale, v_scale, KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    """Blocks of K and V rows (any same shape, their dtype) -> the caches at the pointer blocks k_dst / v_dst
    where `mask`; an FP8 cache gets x / scale saturated to +-FP8_MAX. The rope kernels store through this
    same code (kv_store_args), so a fused store writes store_kv's bits."""
    if KV_FP8:  # saturate, as vLLM: a K outlier past the format's max must not become NaN
        key = tl.minimum(tl.maximum(key.to(tl.float32) / k_scale, -FP8_MAX), FP8_MAX)
        value = tl.minimum(tl.maximum(value.to(tl.float32) / v_scale, -FP8_MAX), FP8_MAX)
    tl.store(k_dst, key.to(k_dst.dtype.element_ty), mask=mask)
    tl.store(v_dst, value.to(v_dst.dtype.element_ty), mask=mask)


def _check_inputs(key, value, key_cache, value_cache, slot_mapping) -> None:
    assert key.dim() == 3 and value.shape == key.shape, f"key/value [T, kvh, d], got {key.shape} {value.shape}"
    assert key_cache.dim() == 4 and value_cache.shape == key_cache.shape, "caches [num_blocks, bs, kvh, d]"
    assert key.shape[1:] == key_cache.shape[2:], f"heads/dims {key.shape[1:]} != cache {key_cache.shape[2:]}"
    assert slot_mapping.shape == (key.shape[0],), f"slot_mapping [{key.shape[0]}], got {slot_mapping.shape}"
    assert key.stride(2) == 1 and value.stride(2) == 1, "key/value rows must be contiguous in head_dim"
    assert key_cache.stride(3) == 1 and value_cache.stride(3) == 1, "cache head_dim must be contiguous"
    assert slot_mapping.dtype in (torch.int32, torch.int64), f"slot_mapping dtype {slot_mapping.dtype}"
    assert value_cache.dtype == key_cache.dtype, f"caches {key_cache.dtype} / {value_cache.dtype}"


def store_kv(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    slot_mapping: torch.Tensor, *, scales: KVScales = UNIT_KV_SCALES,
) -> None:
    """key/value [T, kvh, d] -> key_cache/value_cache [num_blocks, block_size, kvh, d] at slot_mapping [T];
    `scales` divide K and V first when the caches are FP8 (ignored otherwise)."""
    _check_inputs(key, value, key_cache, value_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    kv_fp8 = is_fp8(key_cache.dtype)
    _store_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping, scales.k_scale, scales.v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=key_cache.shape[1], KV_FP8=kv_fp8,
        FP8_MAX=torch.finfo(key_cache.dtype).max if kv_fp8 else 0.0,
    )


def store_kv_ref(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    slot_mapping: torch.Tensor, *, scales: KVScales = UNIT_KV_SCALES,
) -> None:
    """Plain-torch `store_kv` (negative slots skipped; FP8 caches quantized with `scales`)."""
    _check_inputs(key, value, key_cache, value_cache, slot_mapping)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    num_kv_heads, head_dim = key_cache.shape[2:]
    key_cache.view(-1, num_kv_heads, head_dim)[slots] = quantize_kv(key[keep], key_cache.dtype, scales.k_scale)
    value_cache.view(-1, num_kv_heads, head_dim)[slots] = quantize_kv(value[keep], value_cache.dtype, scales.v_scale)


def kv_store_args(
    key: torch.Tensor, value: torch.Tensor | None, key_cache: torch.Tensor | None, value_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor | None, scales: KVScales = UNIT_KV_SCALES,
) -> tuple[list[object], dict[str, object]]:
    """What a rope kernel needs to also store its rotated key [T, kvh, d] and `value` [T, kvh, d] as
    `store_kv` would: (its 14 runtime arguments, its constexprs). All of value, the caches and slot_mapping,
    or none of them (STORE_KV off, key standing in for the unused pointers)."""
    given = [x is not None for x in (value, key_cache, value_cache, slot_mapping)]
    assert all(given) or not any(given), "value, key_cache, value_cache and slot_mapping come together"
    if value is None or key_cache is None or value_cache is None or slot_mapping is None:
        unused: list[object] = [key] * 4 + [1.0, 1.0] + [0] * 8
        return unused, {"BLOCK_SIZE": 1, "KV_FP8": False, "FP8_MAX": 0.0, "STORE_KV": False}
    _check_inputs(key, value, key_cache, value_cache, slot_mapping)
    kv_fp8 = is_fp8(key_cache.dtype)
    args: list[object] = [
        value, slot_mapping, key_cache, value_cache, scales.k_scale, scales.v_scale, value.stride(0), value.stride(1),
        *key_cache.stride()[:3], *value_cache.stride()[:3],
    ]
    return args, {"BLOCK_SIZE": key_cache.shape[1], "KV_FP8": kv_fp8,
                  "FP8_MAX": torch.finfo(key_cache.dtype).max if kv_fp8 else 0.0, "STORE_KV": True}
