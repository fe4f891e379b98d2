"""Split-K x @ W^T into float32 partial sums that the next add_rms_norm adds up (issue 38, Qwen3's o/down).

The model: the K dimension is cut into S equal chunks (multiples of BLOCK_K, the last one ragged) and program
(tile, s) multiplies its [BLOCK_M, BLOCK_N] output tile over chunk s only, accumulating `tl.dot` in float32
and storing the float32 tile to partials[s] of `PartialSums` ([S, M, N]). Nothing adds the S slices here:
in the decoder's residual-stream form every o_proj and down_proj output goes straight into an
add_rms_norm, whose one program per row adds the S partials in float32 in split order and rounds them to
the 16-bit dtype (kernels/add_rms_norm.py `add_rms_norm_partials`), so the reduction costs no launch.
With `silu` the A operand is a gate_up row [M, 2K] = [gate | up] and the tile loader computes the SwiGLU
with kernels/silu_and_mul.py's rounding steps (silu in float32 rounded to the dtype, the product in float32
rounded to the dtype): the down projection then also absorbs the silu_and_mul launch.

Why: at batch 256 Qwen3-0.6B's o_proj (K 2,048 -> N 1,024) takes 6.7 µs and down_proj (3,072 -> 1,024)
8.5 µs in cuBLAS for 4 and 6 MB of weights. With N = 1,024 an output-tile grid has few programs, each
walking all of K; S splits give S times the programs, each reading 1/S of the weights. The plan table
(`splitk_plan`) is where the engine uses it; benchmarks/gpu/splitk_probe.py times the same kernel.

M, N and K tails are masked. Triton's interpreter (3.9) computes bf16 wrong, so the CPU tests run float32;
the bf16 cases are GPU tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conveyor.kernels.triton_compat import tl, triton


@dataclass(frozen=True)
class SplitKPlan:
    """One launch shape: the output tile, the K step, warps and pipeline stages per program, and the splits."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    splits: int
    """K is cut into at most this many chunks (fewer where K is short: a chunk is a whole number of BLOCK_K)."""


@dataclass(frozen=True)
class PartialSums:
    """A projection's output as S float32 partial products: the output is their sum rounded to `dtype`."""

    partials: torch.Tensor
    """[S, M, N] float32: partials[s] = A[:, chunk s] @ W[:, chunk s]^T."""
    dtype: torch.dtype
    """The projection's output dtype (its input's 16-bit dtype)."""

    @property
    def num_rows(self) -> int:
        return self.partials.shape[1]

    @property
    def num_cols(self) -> int:
        return self.partials.shape[2]

    def total(self) -> torch.Tensor:
        """The [M, N] output in `dtype`: the partials added in float32 in split order (as add_rms_norm_partials
        adds them), rounded once."""
        acc = self.partials[0].clone()  # [M, N] float32
        for part in self.partials[1:]:
            acc += part
        return acc.to(self.dtype)


SPLITK_MAX_ROWS = 512
"""More rows (prefill-sized) leave the projection to cuBLAS: its own tiles have programs enough there."""
SPLITK_MAX_COLS = 2048
"""Wider outputs (Llama-3.1-8B's 4,096) give an output-tile grid programs enough without splitting K."""

# (largest K, plan): the first entry holding K wins; K must also be at least 2 N (see `splitk_plan`).
# Set from benchmarks/gpu/splitk_probe.py's GPU timings (the lead updates it from the H100's numbers).
_PLANS: tuple[tuple[int, SplitKPlan], ...] = (
    (2048, SplitKPlan(64, 64, 128, num_warps=4, num_stages=3, splits=4)),
    (1 << 62, SplitKPlan(64, 64, 128, num_warps=4, num_stages=3, splits=8)),
)


def splitk_plan(num_rows: int, n: int, k: int) -> SplitKPlan | None:
    """The plan of an [num_rows, k] @ [n, k]^T projection, or None to leave it to cuBLAS: 1 to
    SPLITK_MAX_ROWS rows, N up to SPLITK_MAX_COLS, K at least 2 N (a long walk over K for each output tile),
    N and K multiples of 16."""
    if not 0 < num_rows <= SPLITK_MAX_ROWS or n > SPLITK_MAX_COLS or k < 2 * n or n % 16 or k % 16:
        return None
    return next(plan for max_k, plan in _PLANS if k <= max_k)


# M (the step's rows) changes every step: specialized on "== 1" / "divisible by 16" it would compile new variants
# mid-serving (worker/warmup.py); it only masks rows and offsets whole N-wide rows, so nothing is lost.
@triton.jit(do_not_specialize=["M"])
def _splitk_kernel(a_ptr, w_ptr, p_ptr, M, N, K, stride_am, stride_wn, k_per_split, SILU: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # a [M, K] (SILU: [M, 2K] = [gate | up]), w [N, K], p [S, M, N] float32: p[s] = a[:, Ks] @ w[:, Ks]^T
    pid, split = tl.program_id(0), tl.program_id(1)
    num_n = tl.cdiv(N, BLOCK_N)
    rm = (pid // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    rn = (pid % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    mask_m, mask_n = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, k_per_split, BLOCK_K):
        rk = split * k_per_split + kk + tl.arange(0, BLOCK_K)  # [BK]
        mask_k = rk < K
        a_mask = mask_m[:, None] & mask_k[None, :]
        a_rows = a_ptr + rm[:, None].to(tl.int64) * stride_am + rk[None, :]  # [BM, BK]
        a = tl.load(a_rows, mask=a_mask, other=0.0)
        if SILU:  # a is the gate; silu(0) * 0 keeps the masked elements zero
            up = tl.load(a_rows + K, mask=a_mask, other=0.0)
            g32 = a.to(tl.float32)
            act = (g32 / (1.0 + tl.exp(-g32))).to(up.dtype)
            a = (act.to(tl.float32) * up.to(tl.float32)).to(up.dtype)
        w = tl.load(w_ptr + rn[None, :].to(tl.int64) * stride_wn + rk[:, None],
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # [BK, BN]: W^T's tile
        acc = tl.dot(a, w, acc)  # [BM, BN] float32
    out = p_ptr + (split.to(tl.int64) * M + rm[:, None]) * N + rn[None, :]  # [BM, BN]
    tl.store(out, acc, mask=mask_m[:, None] & mask_n[None, :])


def _k_per_split(k: int, plan: SplitKPlan) -> int:
    """Columns of K per split: K / splits rounded up to whole BLOCK_K steps (the last split takes the rest)."""
    return triton.cdiv(triton.cdiv(k, plan.splits), plan.block_k) * plan.block_k


def splitk_linear(a: torch.Tensor, weight: torch.Tensor, silu: bool, plan: SplitKPlan) -> PartialSums:
    """a [M, K] (silu: gate_up [M, 2K], the SwiGLU computed on load) @ weight [N, K]^T -> PartialSums
    ([S, M, N] float32, S = ceil(K / k_per_split) <= plan.splits) in a's dtype; rows of a and weight contiguous."""
    (num_rows, width), (n, k) = a.shape, weight.shape
    assert width == (2 * k if silu else k), f"a {tuple(a.shape)} weight {tuple(weight.shape)} silu={silu}"
    assert a.dtype == weight.dtype and a.stride(1) == 1 and weight.stride(1) == 1, "one dtype, contiguous rows"
    k_per_split = _k_per_split(k, plan)
    num_splits = triton.cdiv(k, k_per_split)
    partials = torch.empty(num_splits, num_rows, n, dtype=torch.float32, device=a.device)  # [S, M, N]
    if num_rows > 0:
        grid = (triton.cdiv(num_rows, plan.block_m) * triton.cdiv(n, plan.block_n), num_splits)
        _splitk_kernel[grid](a, weight, partials, num_rows, n, k, a.stride(0), weight.stride(0), k_per_split,
                             SILU=silu, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
                             num_warps=plan.num_warps, num_stages=plan.num_stages)
    return PartialSums(partials, a.dtype)


def swiglu_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [M, 2I] -> [M, I] with the kernels' rounding steps: silu in float32 rounded to the dtype, the
    product in float32 rounded to the dtype."""
    gate, up = gate_up.chunk(2, dim=-1)  # [M, I] each
    g32 = gate.float()
    act = (g32 / (1.0 + torch.exp(-g32))).to(gate.dtype)
    return (act.float() * up.float()).to(gate.dtype)


def splitk_linear_ref(a: torch.Tensor, weight: torch.Tensor, silu: bool, plan: SplitKPlan) -> PartialSums:
    """The kernel's partial sums in torch: the same K chunks, each a float32 product."""
    x = swiglu_ref(a) if silu else a  # [M, K]
    k = weight.shape[1]
    step = _k_per_split(k, plan)
    parts = [x[:, s:s + step].float() @ weight[:, s:s + step].float().t() for s in range(0, k, step)]  # S x [M, N]
    return PartialSums(torch.stack(parts), a.dtype)
