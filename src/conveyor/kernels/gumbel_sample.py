"""One-kernel sampling: a categorical draw from softmax(logits / T) per row by the Gumbel-max trick.

The model: argmax_v(logit_v / T + g_v), with g_v = -log(-log u_v) and u_v ~ U(0, 1) independent, is a
draw from softmax(logit / T). It is the sampler's exponential race argmax_v(p_v / q_v), q_v = -log u_v
~ Exp(1), in log space (log p_v = logit_v / T minus the row's log-partition, a constant), so the
softmax, the division and the noise tensor never exist: the logits are read once, in their own dtype
(bf16 straight from the LM head, or float32). The uniforms come from Philox inside the kernel
(`tl.rand4x`: one call, four words, four columns), keyed by a per-step seed that is loaded from a
device tensor (drawn from the runner's generator on the device, so no host sync) and counted by
(row, tile, lane), so every element of every row gets its own. The vocabulary is split into tiles of
BLOCK columns, grid [N, ceil(V / BLOCK)], so that a handful of rows still fills the GPU: each program
writes its tile's best (score, column) and a second kernel, one program per row, reduces those. Ties
go to the lowest column at both levels, as torch.argmax. A row with temperature 0 is greedy: its
score is the logit itself, so it gets exactly torch.argmax (and no Philox call). u is
clamped into [UNIFORM_MIN, UNIFORM_MAX] and -log u to at least EXP_MIN, so the noise is always
finite: a -inf logit stays -inf and wins only when its whole row is -inf.
"""

import math

import torch

from conveyor.kernels.triton_compat import HAS_TRITON, tl, triton

BLOCK = 4096
"""Columns per program: four sub-tiles of BLOCK / 4 (one Philox call gives one word for each)."""
UNIFORM_MIN = 2.0**-32
"""Smallest u used: Philox can give u = 0 exactly (odds 2^-31 a column, a few times a second at
N = 256, V = 128k), whose -log(-log u) would be -inf."""
UNIFORM_MAX = 1.0 - 2.0**-24
"""Largest u used: the largest float32 below 1, so that -log u > 0."""
LOG2_E = math.log2(math.e)
EXP_MIN = 1e-30
"""Smallest -log u used, so that log(-log u) is finite whatever the rounding of the log of u near 1."""


@triton.jit
def _tile_uniforms(seed_ptr, row, tile, num_tiles, SUB: tl.constexpr):
    """Four [SUB] blocks of U[0, 1): one Philox call per lane, counted by (row, tile, lane) so that no
    two columns of a step share a counter; block k is for the tile's columns [k SUB, (k + 1) SUB)."""
    counter = (row * num_tiles + tile) * SUB + tl.arange(0, SUB)  # [SUB] int64
    return tl.rand4x(tl.load(seed_ptr), counter)


@triton.jit
def _exponential(u, U_MIN: tl.constexpr, U_MAX: tl.constexpr, Q_MIN: tl.constexpr):
    """q = -log u ~ Exp(1), finite and > 0 for any u in [0, 1] (an accurate log: the winners' q are
    the small ones, from u near 1)."""
    return tl.maximum(-tl.log(tl.minimum(tl.maximum(u, U_MIN), U_MAX)), Q_MIN)


@triton.jit
def _tile_best(row_ptr, start, vocab_size, scale, q, SUB: tl.constexpr):
    """Best (score, column) of the columns [start, start + SUB); q [SUB] their Exp(1) noise. The score
    is (logit / T - ln q) * log2(e) = logit * scale - log2 q with scale = log2(e) / T: the argmax of
    logit / T - ln q (a positive factor), in fewer instructions."""
    cols = start + tl.arange(0, SUB)
    logits = tl.load(row_ptr + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32)
    scores = logits * scale - tl.log2(q)  # -inf stays -inf: the noise is finite
    best = tl.argmax(scores, axis=0, tie_break_left=True)  # padding (-inf) sits after every real column
    return tl.max(scores, axis=0), start + best


@triton.jit
def _fold(score, col, row_ptr, start, vocab_size, scale, q, SUB: tl.constexpr):
    """(score, col) updated with the columns [start, start + SUB), all above col: a tie keeps col."""
    other_score, other_col = _tile_best(row_ptr, start, vocab_size, scale, q, SUB)
    take = other_score > score
    return tl.where(take, other_score, score), tl.where(take, other_col, col)


@triton.jit
def _noisy_tile_best(row_ptr, seed_ptr, row, tile, num_tiles, vocab_size, scale, SUB: tl.constexpr,
                     U_MIN: tl.constexpr, U_MAX: tl.constexpr, Q_MIN: tl.constexpr):
    """Best (score, column) of tile `tile` (4 * SUB columns) of a row that draws at random."""
    start = tile * (4 * SUB)
    u0, u1, u2, u3 = _tile_uniforms(seed_ptr, row, tile, num_tiles, SUB)
    score, col = _tile_best(row_ptr, start, vocab_size, scale, _exponential(u0, U_MIN, U_MAX, Q_MIN), SUB)
    q1 = _exponential(u1, U_MIN, U_MAX, Q_MIN)
    score, col = _fold(score, col, row_ptr, start + SUB, vocab_size, scale, q1, SUB)
    q2 = _exponential(u2, U_MIN, U_MAX, Q_MIN)
    score, col = _fold(score, col, row_ptr, start + 2 * SUB, vocab_size, scale, q2, SUB)
    q3 = _exponential(u3, U_MIN, U_MAX, Q_MIN)
    return _fold(score, col, row_ptr, start + 3 * SUB, vocab_size, scale, q3, SUB)


@triton.jit
def _greedy_tile_best(row_ptr, tile, vocab_size, BLOCK: tl.constexpr):
    """Best (logit, column) of tile `tile` of a greedy row: no noise, so exactly torch.argmax's choice."""
    cols = tile * BLOCK + tl.arange(0, BLOCK)
    logits = tl.load(row_ptr + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32)
    return tl.max(logits, axis=0), tile * BLOCK + tl.argmax(logits, axis=0, tie_break_left=True)


@triton.jit
def _gumbel_tile_kernel(logits_ptr, temperature_ptr, seed_ptr, tile_score_ptr, tile_col_ptr,
                        vocab_size, stride_row, num_tiles, SUB: tl.constexpr, U_MIN: tl.constexpr,
                        U_MAX: tl.constexpr, Q_MIN: tl.constexpr, LOG2_E: tl.constexpr):
    """One tile of 4 * SUB columns of one row -> its best (score, column)."""
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    row_ptr = logits_ptr + row * stride_row
    temperature = tl.load(temperature_ptr + row)
    if temperature > 0.0:  # a greedy row skips the noise: Philox is most of the kernel's work
        scale = LOG2_E / temperature
        score, col = _noisy_tile_best(row_ptr, seed_ptr, row, tile, num_tiles, vocab_size, scale, SUB,
                                      U_MIN, U_MAX, Q_MIN)
    else:
        score, col = _greedy_tile_best(row_ptr, tile, vocab_size, 4 * SUB)
    tl.store(tile_score_ptr + row * num_tiles + tile, score)
    tl.store(tile_col_ptr + row * num_tiles + tile, col)


@triton.jit
def _uniforms_kernel(out_ptr, seed_ptr, vocab_size, num_tiles, SUB: tl.constexpr):
    """The uniforms `_gumbel_tile_kernel` draws, written out [N, V] (for tests against the reference)."""
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    u0, u1, u2, u3 = _tile_uniforms(seed_ptr, row, tile, num_tiles, SUB)
    cols = tile * (4 * SUB) + tl.arange(0, SUB)
    row_ptr = out_ptr + row * vocab_size
    tl.store(row_ptr + cols, u0, mask=cols < vocab_size)
    tl.store(row_ptr + cols + SUB, u1, mask=cols + SUB < vocab_size)
    tl.store(row_ptr + cols + 2 * SUB, u2, mask=cols + 2 * SUB < vocab_size)
    tl.store(row_ptr + cols + 3 * SUB, u3, mask=cols + 3 * SUB < vocab_size)


@triton.jit
def _gumbel_reduce_kernel(tile_score_ptr, tile_col_ptr, out_ptr, num_tiles, TILES_PAD: tl.constexpr):
    """A row's tile bests [num_tiles] -> its token id: the best tile, the lowest one on a tie."""
    row = tl.program_id(0).to(tl.int64)
    tiles = tl.arange(0, TILES_PAD)
    scores = tl.load(tile_score_ptr + row * num_tiles + tiles, mask=tiles < num_tiles, other=float("-inf"))
    best = tl.argmax(scores, axis=0, tie_break_left=True)  # padding sits after every real tile
    col = tl.load(tile_col_ptr + row * num_tiles + best)
    tl.store(out_ptr + row, col.to(tl.int64))


def gumbel_sample_supported(device: torch.device) -> bool:
    """Whether `gumbel_sample` can launch for tensors on `device` (CUDA, with Triton installed)."""
    return device.type == "cuda" and HAS_TRITON


def gumbel_sample(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    """logits [N, V] (bf16, fp16 or float32; rows contiguous, any row stride), temperature [N] float32
    (0: greedy), seed [1] int64 on the device -> [N] int64 token ids, on the device (no host sync)."""
    assert logits.dim() == 2 and logits.stride(1) == 1, f"logits {tuple(logits.shape)} need contiguous rows"
    assert logits.dtype in (torch.bfloat16, torch.float16, torch.float32), logits.dtype
    num_rows, vocab_size = logits.shape
    assert temperature.shape == (num_rows,) and temperature.dtype == torch.float32, temperature.shape
    assert seed.shape == (1,) and seed.dtype == torch.int64, f"seed {tuple(seed.shape)} {seed.dtype}"
    assert temperature.device == logits.device == seed.device, "logits, temperature and seed on one device"
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    num_tiles = triton.cdiv(vocab_size, BLOCK)
    tile_scores = torch.empty(num_rows, num_tiles, dtype=torch.float32, device=logits.device)
    tile_cols = torch.empty(num_rows, num_tiles, dtype=torch.int32, device=logits.device)
    _gumbel_tile_kernel[(num_rows, num_tiles)](
        logits, temperature.contiguous(), seed, tile_scores, tile_cols, vocab_size, logits.stride(0),
        num_tiles, SUB=BLOCK // 4, U_MIN=UNIFORM_MIN, U_MAX=UNIFORM_MAX, Q_MIN=EXP_MIN, LOG2_E=LOG2_E, num_warps=4,
    )
    _gumbel_reduce_kernel[(num_rows,)](tile_scores, tile_cols, out, num_tiles,
                                       TILES_PAD=triton.next_power_of_2(num_tiles), num_warps=1)
    return out


def gumbel_sample_ref(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The kernel's computation with the uniforms given: logits [N, V], temperature [N] (0: greedy),
    uniform [N, V] in [0, 1) -> [N] int64 argmax_v(logit_v / T + g_v), g = -log(-log u)."""
    assert logits.dim() == 2 and uniform.shape == logits.shape, f"{tuple(logits.shape)} {tuple(uniform.shape)}"
    assert temperature.shape == (logits.shape[0],), tuple(temperature.shape)
    logits = logits.float()
    q = (-uniform.float().clamp(UNIFORM_MIN, UNIFORM_MAX).log()).clamp_min(EXP_MIN)  # [N, V] ~ Exp(1)
    t = temperature.float().unsqueeze(1)  # [N, 1]
    noisy = logits / t.clamp_min(1e-30) - q.log()
    return torch.where(t > 0, noisy, logits).argmax(dim=-1)


def gumbel_uniforms(num_rows: int, vocab_size: int, seed: torch.Tensor) -> torch.Tensor:
    """[num_rows, vocab_size] float32: the uniforms `gumbel_sample` draws for this shape and seed, so
    that `gumbel_sample_ref(logits, temperature, gumbel_uniforms(...))` is what the kernel computes."""
    assert seed.shape == (1,) and seed.dtype == torch.int64, f"seed {tuple(seed.shape)} {seed.dtype}"
    out = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=seed.device)
    num_tiles = triton.cdiv(vocab_size, BLOCK)
    if num_rows > 0:
        _uniforms_kernel[(num_rows, num_tiles)](out, seed, vocab_size, num_tiles, SUB=BLOCK // 4, num_warps=4)
    return out
