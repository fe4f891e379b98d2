"""Layers shared by every model family: RMSNorm, rotary embedding, gated MLP, embedding and LM head.

Numerics follow Hugging Face transformers so that greedy decoding matches it token for token:
RMSNorm normalizes in float32 and casts back before the weight; rope computes cos/sin in float32
from `positions * inv_freq` and uses the rotate_half convention (the head's first half pairs with
its second half), with llama3 frequency scaling computed exactly as transformers does.
The LM head lives in each model (`compute_logits`), reading the embedding matrix when tied.
Projections that read the same input are fused (q/k/v into one matmul, gate/up into one) because
on small batches one large GEMM is markedly faster than several small ones.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.kernels.add_rms_norm import add_rms_norm, add_rms_norm_partials
from conveyor.kernels.cpu_build import cpu_kernels_available
from conveyor.kernels.cpu_gemm import prefill_linear
from conveyor.kernels.elementwise_cpu import rms_norm_cpu, rotary_cpu_, silu_and_mul_cpu
from conveyor.kernels.fp8_linear import fp8_linear, fp8_linear_per_token
from conveyor.kernels.fp8_quant import FP8_DTYPE
from conveyor.kernels.rms_norm import rms_norm
from conveyor.kernels.rotary import rotary_
from conveyor.kernels.silu_and_mul import silu_and_mul
from conveyor.kernels.splitk_linear import PartialSums, splitk_linear, splitk_plan
from conveyor.kernels.triton_compat import HAS_TRITON
from conveyor.kernels.triton_gemm import triton_fp8_linear, triton_gemm
from conveyor.model.registry import RopeScaling, RopeType


def use_fused_kernels(x: torch.Tensor) -> bool:
    """On CUDA with Triton and a 16-bit dtype, norms / rope / SwiGLU run as one kernel each (eager's
    rounding steps, up to one ulp)."""
    return HAS_TRITON and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


def use_cpu_kernels(x: torch.Tensor) -> bool:
    """On CPU in float32, norms / rope / SwiGLU run as one C loop each (kernels/elementwise_cpu.py:
    the eager formulas up to float32 summation order) where the CPU kernels build; eager otherwise."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and cpu_kernels_available()


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), computed in float32 over the last dimension."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_fused_kernels(x) and x.stride(-1) == 1:
            return rms_norm(x, self.weight, self.eps)
        if use_cpu_kernels(x) and x.stride(-1) == 1:
            rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
            return rms_norm_cpu(rows, self.weight, self.eps).view(x.shape)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_and_norm(self, x: torch.Tensor | PartialSums,
                     residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual [T, hidden] -> (self(x + residual), x + residual): one launch where the fused
        kernels run (kernels/add_rms_norm.py, the same bits as the add then `forward`), both steps elsewhere.
        x may be a split-K projection's partials (`Linear.partial_sums`): that launch adds them up too."""
        fusable = (use_fused_kernels(residual) and residual.dim() == 2 and residual.dtype == self.weight.dtype
                   and residual.stride(-1) == 1)
        if isinstance(x, PartialSums):
            if fusable and x.dtype == residual.dtype:
                return add_rms_norm_partials(x, residual, self.weight, self.eps)
            x = x.total()  # [T, hidden]
        if fusable and x.dim() == 2 and x.dtype == residual.dtype and x.stride(-1) == 1:
            return add_rms_norm(x, residual, self.weight, self.eps)
        total = x + residual
        return self(total), total


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, scaled as `scaling` says (HF semantics)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling.rope_type == RopeType.LINEAR:
        return inv_freq / scaling.factor
    if scaling.rope_type == RopeType.LLAMA3:
        return _llama3_scale(inv_freq, scaling)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate in between."""
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for the step's positions, computed once per forward and shared by all layers."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)

    def reset_inv_freq(self) -> None:
        """Recompute the buffer (after the module was materialized from the meta device)."""
        self.inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(self.inv_freq.device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin), each [T, head_dim] in `dtype`."""
        freqs = positions[:, None].float() * self.inv_freq.float()[None, :]  # [T, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, d]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., d] -> [..., d]: (x1, x2) -> (-x2, x1) over the two halves."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d], cos/sin [T, d] -> rotated x (same shape)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + rotate_half(x) * sin


def apply_rotary_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rotary` on q [T, H, d] and k [T, kvh, d]; on CUDA one in-place kernel for both."""
    if rotary_fusable(q, k, cos):
        rotary_(q, k, cos, sin)
        return q, k
    if use_cpu_kernels(q) and k.dtype == cos.dtype == torch.float32 and _heads_contiguous(q) and _heads_contiguous(k):
        rotary_cpu_(q, cos, sin)  # in place: q and k are fresh views into this step's qkv output
        rotary_cpu_(k, cos, sin)
        return q, k
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def rotary_fusable(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether rope of q [T, H, d] and k [T, kvh, d] runs as kernels/rotary.py's one in-place `rotary_`."""
    head_dim = q.shape[-1]
    return use_fused_kernels(q) and q.dtype == k.dtype == cos.dtype and head_dim & (head_dim - 1) == 0


def _heads_contiguous(x: torch.Tensor) -> bool:
    """x [T, heads, d] with each token's heads back to back (tokens may be strided)."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


CPU_FEW_ROWS = 256
"""Up to this many rows a CPU projection runs as (W @ x^T)^T (see `Linear`)."""


def padded_rows(num_rows: int) -> int:
    """Row count a few-row CPU projection computes: up to a multiple of 4 (<= 8 rows) or of 16."""
    multiple = 4 if num_rows <= 8 else 16
    return -(-num_rows // multiple) * multiple


class Linear(nn.Linear):
    """nn.Linear whose CPU forward for few rows (decode-heavy steps) computes (W @ x^T)^T.

    MKL's `x @ W^T` path for a handful of rows re-packs the whole weight on every call; the
    transposed orientation streams it once. SmolLM2 shapes, 2 threads: a layer's four projections
    1.97 -> 1.59 ms at 8 rows, 2.43 -> 1.09 ms at 4; no gain for prefill-sized inputs, which go to
    oneDNN (`prefill_linear`). Rows are zero-padded to `padded_rows` (MKL's small-M kernels are up
    to 2x slower off multiples of 4 / 16 on this CPU: gate_up + down at 11 rows 2.31 ms, at 16 1.60).
    The result is made contiguous again (callers view it per head). CUDA: F.linear, or with
    --gemm-backend triton (`use_triton_gemm`, set by model/loader.py's `use_triton_linears`)
    kernels/triton_gemm.py where it takes the operands. With --quantization fp8 the weight is float8 and
    `weight_scale` its per-tensor scale (model/fp8_weights.py).
    """

    weight_scale: torch.Tensor | None = None
    """Float32 scale of an FP8 weight: [] per tensor (fp8), [1, N] per channel (ptpc_fp8); None: 16-bit."""
    input_scale: torch.Tensor | None = None
    """[] float32 static activation scale of an FP8 checkpoint's "static" scheme (None: dynamic)."""
    use_triton_gemm: bool = False
    """--gemm-backend triton: CUDA inputs take kernels/triton_gemm.py (`triton_linear`) where it can."""
    tensor_parallel: bool = False
    """A tensor-parallel shard (model/parallel_layers.py): its output is one rank's part, no split-K partials."""
    fused_launches = True
    """`partial_sums` may hand the next norm split-K partials (`set_fused_launches(False)` turns it off)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.weight_scale, self.input_scale, self.use_triton_gemm)

    def partial_sums(self, x: torch.Tensor, silu: bool = False) -> PartialSums | None:
        """The one decision of split-K (kernels/splitk_linear.py): x [M, K] (silu: gate_up [M, 2K], the SwiGLU
        taken while loading) @ W^T as float32 partials that the caller's next `RMSNorm.add_and_norm` sums, or
        None for the usual path. Taken where the fused launches are on, x is a CUDA 16-bit tensor of the
        weight's dtype with contiguous rows, the projection is plain (no bias, no FP8 scales, not
        --gemm-backend triton, no tensor-parallel shard: a row-parallel one's output is one rank's part of an
        all-reduce) and `splitk_plan` has a plan for the shape."""
        num_out, k = self.weight.shape
        plain = (self.bias is None and self.weight_scale is None and self.input_scale is None
                 and not self.use_triton_gemm and not self.tensor_parallel and self.weight.stride(1) == 1)
        operand = (use_fused_kernels(x) and x.dtype == self.weight.dtype and x.dim() == 2
                   and x.shape[1] == (2 * k if silu else k) and x.stride(1) == 1)
        plan = splitk_plan(x.shape[0], num_out, k) if self.fused_launches and plain and operand else None
        return None if plan is None else splitk_linear(x, self.weight, silu, plan)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           weight_scale: torch.Tensor | None = None, input_scale: torch.Tensor | None = None,
           use_triton_gemm: bool = False) -> torch.Tensor:
    """F.linear, except on CPU: for x [T <= CPU_FEW_ROWS, in] the padded (W @ x^T)^T of `Linear`, for
    more rows oneDNN's GEMM (kernels/cpu_gemm.py); an FP8 weight (`weight_scale` given): `fp8_linear`.
    `use_triton_gemm` (--gemm-backend triton): a CUDA x goes to `triton_linear` where it takes the operands."""
    if use_triton_gemm and x.is_cuda:
        out = triton_linear(x, weight, bias, weight_scale, input_scale)
        if out is not None:
            return out
    if weight_scale is not None:
        rows = x.reshape(-1, x.shape[-1])
        if weight_scale.dim() == 2:  # per channel: per-token input scales, one launch and a row-wise GEMM
            return fp8_linear_per_token(rows, weight, weight_scale, bias).view(*x.shape[:-1], -1)
        return fp8_linear(rows, weight, weight_scale, bias, input_scale).view(*x.shape[:-1], -1)
    if x.device.type != "cpu" or x.dim() != 2:
        return F.linear(x, weight, bias)
    if x.shape[0] > CPU_FEW_ROWS:
        return prefill_linear(x, weight, bias)  # oneDNN: 2-2.6x MKL's sgemm on AMD EPYC
    num_rows = x.shape[0]
    x = F.pad(x, (0, 0, 0, padded_rows(num_rows) - num_rows))  # [T', in], zero rows appended
    out = (weight @ x.T).T[:num_rows]  # [T, out] as a transposed view
    if bias is not None:
        out = out + bias
    return out.contiguous()


TRITON_GEMM_MAX_ROWS = 512
"""Above this many rows (prefill-sized) `triton_linear` leaves the projection to cuBLAS: the Triton GEMM's
tiles are chosen for decode M, and lever 6 is about the decode step's weight read."""


def triton_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  weight_scale: torch.Tensor | None, input_scale: torch.Tensor | None) -> torch.Tensor | None:
    """x [..., K] @ weight [N, K]^T by kernels/triton_gemm.py, or None where it does not take the operands
    (the caller's torch path runs instead of an assert): x and a weight of one 16-bit dtype, or an e4m3 weight
    with one per-tensor scale and dynamic input scales (ptpc_fp8's [1, N] and a checkpoint's static input
    scale stay on `_scaled_mm`); N and K multiples of 16; contiguous rows; at most TRITON_GEMM_MAX_ROWS rows."""
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    num_out, k = weight.shape
    if rows.shape[0] > TRITON_GEMM_MAX_ROWS:
        return None
    if num_out % 16 or k % 16 or rows.stride(-1) != 1 or weight.stride(-1) != 1 or rows.shape[1] != k:
        return None
    if bias is not None and (bias.dim() != 1 or bias.stride(0) != 1):
        return None
    if x.dtype not in (torch.bfloat16, torch.float16):
        return None
    if weight_scale is None and weight.dtype == x.dtype:
        out = triton_gemm(rows, weight, bias)  # [M, N]
    elif (weight_scale is not None and weight_scale.dim() == 0 and weight_scale.dtype == torch.float32
          and input_scale is None and weight.dtype == FP8_DTYPE):
        out = triton_fp8_linear(rows, weight, weight_scale, bias)  # [M, N] in x's dtype
    else:
        return None
    return out.view(*x.shape[:-1], num_out)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one [2*I, H] weight."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, partial_sums: bool = False) -> torch.Tensor | PartialSums:
        """x [T, hidden] -> [T, hidden]; with `partial_sums` (the caller's next norm takes them) the down
        projection's split-K partials where `Linear.partial_sums` says so, the SwiGLU taken in its loads."""
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        if partial_sums and (sums := split_k_partials(self.down_proj, gate_up, silu=True)) is not None:
            return sums
        if use_fused_kernels(gate_up):
            act = silu_and_mul(gate_up)  # [T, I]
            del gate_up  # not alive beside down_proj's output: the forward's peak is gate_up + act alone
            return self.down_proj(act)
        if use_cpu_kernels(gate_up) and gate_up.is_contiguous():
            return self.down_proj(silu_and_mul_cpu(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def split_k_partials(proj: nn.Module, x: torch.Tensor, silu: bool = False) -> PartialSums | None:
    """`Linear.partial_sums` of proj, or None for a projection that is no `Linear` (a quantized one)."""
    return proj.partial_sums(x, silu) if isinstance(proj, Linear) else None
