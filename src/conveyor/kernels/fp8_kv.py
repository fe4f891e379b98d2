"""The FP8 KV cache: the dtypes `--kv-cache-dtype` names, per-tensor scales, and the torch quantize and
dequantize every path (torch backend, kernel references, tests) shares with the Triton kernels.

vLLM's format: a cache element is `fp8(clamp(x / scale, -max, max))` and reads back as `fp8 * scale`,
with one scale per layer for K (`k_scale`) and one for V (`v_scale`). Without calibrated scales (no
`--calculate-kv-scales`, no scales in the checkpoint) vLLM uses 1.0 for both, so values are cast as
they are: K and V of bf16 models sit well inside e4m3's +-448. The clamp saturates instead of
producing NaN (e4m3fn has no inf), as vLLM's `scaled_fp8_conversion` and Triton's `satfinite`
conversion both do, so the torch reference and the store kernel write the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_KV_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
"""--kv-cache-dtype values -> the torch element type of the cache (vLLM's: fp8 means e4m3, the `fn`
variant without inf, as on NVIDIA GPUs)."""


@dataclass(frozen=True)
class KVScales:
    """One layer's per-tensor KV scales: cache = x / scale, read back as cache * scale."""

    k_scale: float = 1.0
    """Scale of every K element of the layer (vLLM's `_k_scale`; 1.0 when uncalibrated)."""
    v_scale: float = 1.0
    """Scale of every V element of the layer (vLLM's `_v_scale`)."""

    def __post_init__(self) -> None:
        if not (self.k_scale > 0.0 and self.v_scale > 0.0):
            raise ValueError(f"KV scales must be > 0 (got k_scale={self.k_scale}, v_scale={self.v_scale})")


UNIT_KV_SCALES = KVScales()
"""vLLM's default: no scaling."""


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether a cache of this dtype needs quantizing on write and dequantizing on read."""
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x [..] (any float) -> [..] of `dtype`: x / scale saturated to the format's range, then cast
    (round to nearest even). A non-FP8 `dtype` is a plain cast, as the 16/32-bit caches always were."""
    if not is_fp8(dtype):
        return x.to(dtype)
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-limit, limit).to(dtype)


def dequantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """cache [..] -> [..] of `dtype` (the query's, or float32 in references): x * scale, computed in
    float32 as the kernels do before their dot products."""
    if not is_fp8(x.dtype):
        return x.to(dtype)
    return (x.float() * scale).to(dtype)
