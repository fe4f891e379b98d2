"""y[M, N] = x[M, K] @ W[N, K]^T in one Triton launch, 16-bit or FP8, tiled for decode M (issues 37, 38).

The model: each program owns one [BLOCK_M, BLOCK_N] output tile. It walks K in BLOCK_K steps, loading
an x tile [BLOCK_M, BLOCK_K] and a weight tile read as [BLOCK_K, BLOCK_N] (W's rows are K-contiguous,
the K-major operand the tensor cores take for bf16 and e4m3 alike), and accumulates `tl.dot` in float32.
The epilogue multiplies by s_x * s_w (FP8: two float32 0-dim tensors read on the device, so there is no
host sync and a CUDA graph captures the launch), adds the bias in float32 and rounds once to bf16.

Why: at decode M (1-256 rows) a projection is mostly a weight read. Llama-3.1-8B's gate_up at M = 256
moves 235 MB of bf16 weights and ~17 MB of activations in and out; cuBLAS picks split-K kernels there
that reach ~64-75% of HBM bandwidth (docs/performance.md, "split-K"). Here there is no split-K: the N
tiles alone give the programs (N / BLOCK_N >= 128 on every Llama-3.1-8B projection up to 64 rows), each
weight tile leaves HBM once, and the M tiles of one N tile are adjacent program ids, so they run together
and the later ones find the weight tile in L2. (At M = 256, bf16 does 256 FLOP a weight byte, about the
H100's ridge: there the tensor cores bound it as much as the bytes; at FP8 both bounds halve.) The
configs are a short explicit list by M bucket and element type (no runtime autotune: autotuning would
benchmark inside a CUDA-graph capture); benchmarks/gpu/fp8_gemm.py times them against cuBLAS /
`_scaled_mm`. The engine calls it only under --gemm-backend triton (model/layers.py `triton_linear`): opt-in
until a GPU has timed it end to end.

M is ragged (masked rows); N and K must be multiples of 16 (K tails are masked, N tails clamp the load
and mask the store). Triton's interpreter (3.9) computes a bf16 `tl.dot` wrong, so the CPU tests run the
16-bit path at fp16 and float32; the bf16 cases are the GPU tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conveyor.kernels.fp8_quant import FP8_DTYPE, quantize_fp8_dynamic
from conveyor.kernels.triton_compat import tl, triton


@dataclass(frozen=True)
class GemmConfig:
    """One launch shape: the output tile, the K step, and the warps / pipeline stages per program."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4


# (largest M, config): the first bucket holding M wins. A K step is 128 or 256 bytes of a row at either
# element size, so a stage holds the same bytes at FP8 as at 16 bits. Up to 64 rows: 32-column N tiles,
# so that the narrowest projections still give ~128 programs for the H100's 132 SMs (o_proj: N = 4096)
# and every SM streams weights; one M tile of 64 reads each weight tile once. Larger M: wider tiles.
_CONFIGS_16BIT: tuple[tuple[int, GemmConfig], ...] = (
    (16, GemmConfig(16, 32, 128, num_warps=4, num_stages=5)),
    (64, GemmConfig(64, 32, 128, num_warps=4, num_stages=4)),
    (256, GemmConfig(64, 128, 64, num_warps=4, num_stages=4)),
    (1 << 62, GemmConfig(128, 128, 64, num_warps=8, num_stages=3)),
)
_CONFIGS_FP8: tuple[tuple[int, GemmConfig], ...] = (
    (16, GemmConfig(16, 32, 256, num_warps=4, num_stages=5)),
    (64, GemmConfig(64, 32, 256, num_warps=4, num_stages=4)),
    (256, GemmConfig(64, 128, 128, num_warps=4, num_stages=4)),
    (1 << 62, GemmConfig(128, 128, 128, num_warps=8, num_stages=3)),
)


def pick_config(num_rows: int, fp8: bool) -> GemmConfig:
    """The config of the smallest M bucket holding `num_rows`."""
    table = _CONFIGS_FP8 if fp8 else _CONFIGS_16BIT
    return next(config for max_rows, config in table if num_rows <= max_rows)


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, out_ptr, bias_ptr, x_scale_ptr, w_scale_ptr, M, N, K,
                 stride_xm, stride_wn, stride_om,
                 HAS_BIAS: tl.constexpr, HAS_SCALES: tl.constexpr, EVEN_K: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    num_m_tiles = tl.cdiv(M, BLOCK_M)
    pid = tl.program_id(0)
    pid_m = pid % num_m_tiles  # the M tiles of one N tile are adjacent: they share its weights in L2
    pid_n = pid // num_m_tiles
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    ks = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    # Out-of-range rows / columns read row M-1 / column N-1 again (clamped, no load mask); the store masks.
    x_rows = tl.minimum(rows, M - 1).to(tl.int64)
    w_cols = tl.minimum(cols, N - 1).to(tl.int64)
    x_ptrs = x_ptr + x_rows[:, None] * stride_xm + ks[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + w_cols[None, :] * stride_wn + ks[:, None]  # [BLOCK_K, BLOCK_N]: W^T's tile
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            x = tl.load(x_ptrs, mask=ks[None, :] < K - k, other=0.0)
            w = tl.load(w_ptrs, mask=ks[:, None] < K - k, other=0.0)
        acc = tl.dot(x, w, acc)  # [BLOCK_M, BLOCK_N] float32
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_SCALES:
        acc = acc * (tl.load(x_scale_ptr) * tl.load(w_scale_ptr))
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + w_cols).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def _launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None,
            scales: tuple[torch.Tensor, torch.Tensor] | None, config: GemmConfig) -> torch.Tensor:
    (num_rows, k), num_out = x.shape, weight.shape[0]
    if num_rows == 0:
        return out
    grid = (triton.cdiv(num_rows, config.block_m) * triton.cdiv(num_out, config.block_n),)
    x_scale, w_scale = scales if scales is not None else (out, out)  # unread without HAS_SCALES
    _gemm_kernel[grid](
        x, weight, out, bias if bias is not None else out, x_scale, w_scale, num_rows, num_out, k,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, HAS_SCALES=scales is not None, EVEN_K=k % config.block_k == 0,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    assert x.dim() == 2 and weight.dim() == 2, f"x [M, K], weight [N, K]: {tuple(x.shape)} {tuple(weight.shape)}"
    assert x.shape[1] == weight.shape[1], f"K: x has {x.shape[1]}, weight {weight.shape[1]}"
    assert x.shape[1] % 16 == 0 and weight.shape[0] % 16 == 0, f"N and K must be multiples of 16: {tuple(weight.shape)}"
    assert x.stride(1) == 1 and weight.stride(1) == 1, "rows of x and weight must be contiguous"
    assert bias is None or bias.shape == (weight.shape[0],), f"bias [N]: {None if bias is None else tuple(bias.shape)}"


def triton_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                config: GemmConfig | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype (bf16 / fp16 / float32, float32
    accumulation). `config`: a launch shape other than the M bucket's (the offline sweep)."""
    _check(x, weight, bias)
    assert x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16, torch.float32), f"{x.dtype} {weight.dtype}"
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    return _launch(x, weight, out, bias, None, config or pick_config(x.shape[0], fp8=False))


def triton_fp8_gemm(x_q: torch.Tensor, weight_q: torch.Tensor, x_scale: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
                    config: GemmConfig | None = None) -> torch.Tensor:
    """(x_q [M, K] @ weight_q [N, K]^T) * s_x * s_w (+ bias [N]) -> [M, N] in `out_dtype`: e4m3 operands,
    per-tensor scales as one-element float32 tensors on x's device (read by the kernel: no host sync)."""
    _check(x_q, weight_q, bias)
    assert x_q.dtype == FP8_DTYPE and weight_q.dtype == FP8_DTYPE, f"e4m3 operands: {x_q.dtype} {weight_q.dtype}"
    for scale in (x_scale, weight_scale):
        assert scale.numel() == 1 and scale.dtype == torch.float32, f"scales: one float32 each, got {scale.dtype}"
    out = torch.empty((x_q.shape[0], weight_q.shape[0]), dtype=out_dtype, device=x_q.device)
    return _launch(x_q, weight_q, out, bias, (x_scale, weight_scale), config or pick_config(x_q.shape[0], fp8=True))


def triton_fp8_linear(x: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor,
                      bias: torch.Tensor | None = None, config: GemmConfig | None = None) -> torch.Tensor:
    """kernels/fp8_linear.py's `fp8_linear` with this GEMM in place of `_scaled_mm`: x [M, K] (bf16) is
    quantized per tensor on the device (kernels/fp8_quant.py's two passes), then one launch -> [M, N]."""
    x_q, x_scale = quantize_fp8_dynamic(x)  # [M, K] e4m3, [] float32
    return triton_fp8_gemm(x_q, weight_q, x_scale, weight_scale, bias, out_dtype=x.dtype, config=config)


def triton_gemm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """float32 `x @ weight^T (+ bias)`, returned in x's dtype."""
    out = x.float() @ weight.float().t()  # [M, N]
    return (out if bias is None else out + bias.float()).to(x.dtype)


def triton_fp8_gemm_ref(x_q: torch.Tensor, weight_q: torch.Tensor, x_scale: torch.Tensor, weight_scale: torch.Tensor,
                        bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """float32 product of the dequantized operands, times both scales (+ bias), in `out_dtype`."""
    out = (x_q.float() @ weight_q.float().t()) * (x_scale.float().reshape(()) * weight_scale.float().reshape(()))
    return (out if bias is None else out + bias.float()).to(out_dtype)
