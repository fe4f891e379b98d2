"""Two-kernel sampling: a categorical draw from softmax(logits / T) per row by inverse CDF, one uniform a row.

The model: with x_v = logit_v * log2(e) / T and M = max_v x_v, p_v = exp2(x_v - M) is softmax(logit / T)
times a constant, so the first v whose running sum sum_{j <= v} p_j passes u * sum_j p_j, u ~ U[0, 1), is
a draw from softmax(logit / T). The Gumbel kernel (gumbel_sample.py) needs one Philox word and two logs
per vocabulary element (39M words a step at N = 256, V = 151,936); this one needs one Philox call per
row and one exp2 per element, so it is bound by reading the logits, twice for one tile of each row.

Pass 1, grid [N, ceil(V / BLOCK)], so that a handful of rows still fills the GPU: each tile of a random
row writes (m_t, s_t), its max of x and sum of exp2(x - m_t); a tile of a greedy row (T = 0) writes its
max logit and that logit's column (the lowest on a tie), as the Gumbel kernel's greedy tile does.
Pass 2, one program per row: a greedy row takes the best tile (the lowest on a tie), so it gets exactly
torch.argmax. A random row weighs its tiles w_t = s_t * exp2(m_t - M), takes the first tile whose
cumsum passes target = u * total, then re-reads that tile alone and takes the first column whose cumsum
within it passes the rest, r = target - (the tiles before it). The uniform is Philox keyed by (seed,
row), the seed loaded from a device tensor (no host sync, CUDA-graph safe). A column or tile of weight
0 (a -inf logit) is never chosen while its row has a finite logit: a rounding that leaves no crossing
falls back to the last one of weight > 0; a row of -inf only gives column 0, as torch.argmax.

Exact up to float32 rounding: u's spacing (2^-24 near 1) bounds any token's error to about 2^-24 of
its row's mass, where the Gumbel kernel's error is relative to each token's own probability.

Prediction (H100, N = 256, V = 151,936, bf16): pass 1 reads the logits (77.8 MB) once with one exp2 per
element and pass 2 one tile a row (2 MB), so ~30-40 us a step against the Gumbel kernel's 137 us.
"""

import math

import torch

from conveyor.kernels.triton_compat import HAS_TRITON, tl, triton

BLOCK = 4096
"""Columns per pass-1 program, and the tile pass 2 re-reads."""
UNIFORM_MAX = 1.0 - 2.0**-24
"""Largest u used (the largest float32 below 1), so that target = u * total < total."""
LOG2_E = math.log2(math.e)


@triton.jit
def _row_uniform(seed_ptr, row, U_MAX: tl.constexpr):
    """The row's one uniform in [0, U_MAX]: Philox keyed by (seed, row)."""
    return tl.minimum(tl.rand(tl.load(seed_ptr), row), U_MAX)


@triton.jit
def _log2_scale(temperature, LOG2_E: tl.constexpr):
    """log2(e) / T, the factor from logits to x: IEEE-rounded, as torch divides, so the reference scales alike."""
    return tl.math.div_rn(LOG2_E, temperature)


@triton.jit
def _tile_logits(row_ptr, tile, vocab_size, BLOCK: tl.constexpr):
    """Tile `tile`'s logits in float32, [BLOCK]; columns past the vocabulary read -inf."""
    cols = tile * BLOCK + tl.arange(0, BLOCK)
    return tl.load(row_ptr + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32)


@triton.jit
def _tile_mass(x):
    """(m, s) of one tile's x: m = max x, s = sum exp2(x - m). A tile of -inf gives (-inf, 0): the shift is
    0 there, since -inf - -inf would be NaN."""
    m = tl.max(x, axis=0)
    shift = tl.where(m == float("-inf"), 0.0, m)
    return m, tl.sum(tl.exp2(x - shift), axis=0)


@triton.jit
def _cdf_tile_kernel(logits_ptr, temperature_ptr, tile_max_ptr, tile_sum_ptr, tile_col_ptr, vocab_size,
                     stride_row, num_tiles, BLOCK: tl.constexpr, LOG2_E: tl.constexpr):
    """Pass 1: one tile of one row -> (m_t, s_t) for a random row, (max logit, its column) for a greedy one."""
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    logits = _tile_logits(logits_ptr + row * stride_row, tile, vocab_size, BLOCK)
    temperature = tl.load(temperature_ptr + row)
    slot = row * num_tiles + tile
    if temperature > 0.0:
        m, s = _tile_mass(logits * _log2_scale(temperature, LOG2_E))
        tl.store(tile_max_ptr + slot, m)
        tl.store(tile_sum_ptr + slot, s)
    else:  # padding (-inf) sits after every real column, so a tie keeps the lowest real one
        tl.store(tile_max_ptr + slot, tl.max(logits, axis=0))
        tl.store(tile_col_ptr + slot, tile * BLOCK + tl.argmax(logits, axis=0, tie_break_left=True))


@triton.jit
def _first_crossing(cumsum, weight, target, SIZE: tl.constexpr):
    """The first index whose cumsum passes target among those of weight > 0; where rounding leaves none,
    the last of weight > 0 (0 if none)."""
    index = tl.arange(0, SIZE)
    first = tl.min(tl.where((cumsum > target) & (weight > 0.0), index, SIZE), axis=0)
    last = tl.max(tl.where(weight > 0.0, index, 0), axis=0)
    return tl.where(first < SIZE, first, last)


@triton.jit
def _pick_tile(tile_max_ptr, tile_sum_ptr, base, num_tiles, u, TILES_PAD: tl.constexpr):
    """A random row's tile for uniform u -> (tile, r: the target's rest within it, M: the row's max x, 0 if
    -inf)."""
    tiles = tl.arange(0, TILES_PAD)
    m = tl.load(tile_max_ptr + base + tiles, mask=tiles < num_tiles, other=float("-inf"))
    s = tl.load(tile_sum_ptr + base + tiles, mask=tiles < num_tiles, other=0.0)
    row_max = tl.max(m, axis=0)
    row_max = tl.where(row_max == float("-inf"), 0.0, row_max)  # a row of -inf: every weight 0, no NaN
    weight = s * tl.exp2(m - row_max)
    cumsum = tl.cumsum(weight, axis=0)
    target = u * tl.max(cumsum, axis=0)  # the max, not the last: padding repeats the total
    tile = _first_crossing(cumsum, weight, target, TILES_PAD)
    before = tl.sum(tl.where(tiles == tile, cumsum - weight, 0.0), axis=0)
    return tile, target - before, row_max


@triton.jit
def _column_in_tile(row_ptr, tile, rest, row_max, scale, vocab_size, BLOCK: tl.constexpr):
    """The column of tile `tile` where the row's CDF, restarted at the tile, passes `rest`."""
    p = tl.exp2(_tile_logits(row_ptr, tile, vocab_size, BLOCK) * scale - row_max)
    return tile * BLOCK + _first_crossing(tl.cumsum(p, axis=0), p, rest, BLOCK)


@triton.jit
def _greedy_token(tile_max_ptr, tile_col_ptr, base, num_tiles, TILES_PAD: tl.constexpr):
    """A greedy row's token: the column of its best tile, the lowest tile on a tie."""
    tiles = tl.arange(0, TILES_PAD)
    best_logits = tl.load(tile_max_ptr + base + tiles, mask=tiles < num_tiles, other=float("-inf"))
    best = tl.argmax(best_logits, axis=0, tie_break_left=True)  # padding sits after every real tile
    return tl.load(tile_col_ptr + base + best)


@triton.jit
def _cdf_pick_kernel(logits_ptr, temperature_ptr, seed_ptr, tile_max_ptr, tile_sum_ptr, tile_col_ptr,
                     out_ptr, vocab_size, stride_row, num_tiles, BLOCK: tl.constexpr,
                     TILES_PAD: tl.constexpr, U_MAX: tl.constexpr, LOG2_E: tl.constexpr):
    """Pass 2: one row's tile results -> its token id."""
    row = tl.program_id(0).to(tl.int64)
    base = row * num_tiles
    temperature = tl.load(temperature_ptr + row)
    if temperature > 0.0:
        u = _row_uniform(seed_ptr, row, U_MAX)
        tile, rest, row_max = _pick_tile(tile_max_ptr, tile_sum_ptr, base, num_tiles, u, TILES_PAD)
        col = _column_in_tile(logits_ptr + row * stride_row, tile, rest, row_max,
                              _log2_scale(temperature, LOG2_E), vocab_size, BLOCK)
        tl.store(out_ptr + row, col.to(tl.int64))
    else:
        tl.store(out_ptr + row, _greedy_token(tile_max_ptr, tile_col_ptr, base, num_tiles, TILES_PAD).to(tl.int64))


@triton.jit
def _uniforms_kernel(out_ptr, seed_ptr, U_MAX: tl.constexpr):
    """The uniform `_cdf_pick_kernel` draws for each row, written out [N] (for tests against the reference)."""
    row = tl.program_id(0).to(tl.int64)
    tl.store(out_ptr + row, _row_uniform(seed_ptr, row, U_MAX))


def cdf_sample_supported(device: torch.device) -> bool:
    """Whether `cdf_sample` can launch for tensors on `device` (CUDA, with Triton installed)."""
    return device.type == "cuda" and HAS_TRITON


def _check_inputs(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor) -> None:
    assert logits.dim() == 2 and logits.stride(1) == 1, f"logits {tuple(logits.shape)} need contiguous rows"
    assert logits.dtype in (torch.bfloat16, torch.float16, torch.float32), logits.dtype
    assert temperature.shape == (logits.shape[0],) and temperature.dtype == torch.float32, temperature.shape
    assert seed.shape == (1,) and seed.dtype == torch.int64, f"seed {tuple(seed.shape)} {seed.dtype}"
    assert temperature.device == logits.device == seed.device, "logits, temperature and seed on one device"


def cdf_sample(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    """logits [N, V] (bf16, fp16 or float32; rows contiguous, any row stride), temperature [N] float32
    (0: greedy), seed [1] int64 on the device -> [N] int64 token ids, on the device (no host sync)."""
    _check_inputs(logits, temperature, seed)
    num_rows, vocab_size = logits.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    num_tiles = triton.cdiv(vocab_size, BLOCK)
    tile_max = torch.empty(num_rows, num_tiles, dtype=torch.float32, device=logits.device)
    tile_sum = torch.empty_like(tile_max)  # written by random rows only
    tile_col = torch.empty(num_rows, num_tiles, dtype=torch.int32, device=logits.device)  # greedy rows only
    temperature = temperature.contiguous()
    _cdf_tile_kernel[(num_rows, num_tiles)](logits, temperature, tile_max, tile_sum, tile_col, vocab_size,
                                            logits.stride(0), num_tiles, BLOCK=BLOCK, LOG2_E=LOG2_E, num_warps=4)
    _cdf_pick_kernel[(num_rows,)](logits, temperature, seed, tile_max, tile_sum, tile_col, out, vocab_size,
                                  logits.stride(0), num_tiles, BLOCK=BLOCK,
                                  TILES_PAD=triton.next_power_of_2(num_tiles), U_MAX=UNIFORM_MAX,
                                  LOG2_E=LOG2_E, num_warps=4)
    return out


def cdf_uniforms(num_rows: int, seed: torch.Tensor) -> torch.Tensor:
    """[num_rows] float32: the uniforms `cdf_sample` draws for this seed, so that
    `cdf_sample_ref(logits, temperature, cdf_uniforms(N, seed))` is what the kernel computes."""
    assert seed.shape == (1,) and seed.dtype == torch.int64, f"seed {tuple(seed.shape)} {seed.dtype}"
    out = torch.empty(num_rows, dtype=torch.float32, device=seed.device)
    if num_rows > 0:
        _uniforms_kernel[(num_rows,)](out, seed, U_MAX=UNIFORM_MAX, num_warps=1)
    return out


def _first_crossing_ref(cumsum: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """`_first_crossing` over the last dim: cumsum, weight [N, K], target [N, 1] -> [N] int64."""
    size = cumsum.shape[-1]
    index = torch.arange(size, device=cumsum.device)
    first = torch.where((cumsum > target) & (weight > 0), index, size).amin(dim=-1)
    last = torch.where(weight > 0, index, 0).amax(dim=-1)
    return torch.where(first < size, first, last)


def _scaled_tiles(logits: torch.Tensor, temperature: torch.Tensor, block: int) -> torch.Tensor:
    """x = logit * log2(e) / T in float32, padded with -inf to whole tiles: [N, tiles, block] (T = 0: scale 1)."""
    t = temperature.float().unsqueeze(1)  # [N, 1]
    x = logits.float() * (LOG2_E / torch.where(t > 0, t, 1.0))  # [N, V]
    num_tiles = -(-logits.shape[1] // block)
    x = torch.nn.functional.pad(x, (0, num_tiles * block - logits.shape[1]), value=float("-inf"))
    return x.view(logits.shape[0], num_tiles, block)


def _tile_weights(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, tiles, block] -> (w [N, tiles]: each tile's mass relative to the row's max, M [N, 1, 1]: the
    row's max x, 0 if -inf), as pass 1 and `_pick_tile` compute them."""
    tile_max = x.amax(dim=-1)  # [N, tiles]
    shift = torch.where(tile_max == float("-inf"), 0.0, tile_max)
    tile_sum = torch.exp2(x - shift.unsqueeze(-1)).sum(dim=-1)
    row_max = tile_max.amax(dim=-1, keepdim=True)
    row_max = torch.where(row_max == float("-inf"), 0.0, row_max)  # [N, 1]
    return tile_sum * torch.exp2(tile_max - row_max), row_max.unsqueeze(-1)


def cdf_sample_ref(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor,
                   block: int = BLOCK) -> torch.Tensor:
    """The kernels' computation in torch with the uniforms given: logits [N, V], temperature [N] (0:
    greedy), uniform [N] in [0, 1) -> [N] int64, tile by tile of `block` columns as the kernels go."""
    assert logits.dim() == 2 and uniform.shape == (logits.shape[0],), f"{tuple(logits.shape)} {uniform.shape}"
    assert temperature.shape == (logits.shape[0],), tuple(temperature.shape)
    x = _scaled_tiles(logits, temperature, block)  # [N, tiles, block]
    weight, row_max = _tile_weights(x)
    cumsum = weight.cumsum(dim=-1)  # [N, tiles]
    target = uniform.float().clamp(0.0, UNIFORM_MAX) * cumsum.amax(dim=-1)  # [N]
    tile = _first_crossing_ref(cumsum, weight, target.unsqueeze(1))  # [N]
    rest = target - (cumsum - weight).gather(1, tile.unsqueeze(1)).squeeze(1)
    rows = torch.arange(logits.shape[0], device=logits.device)
    p = torch.exp2(x[rows, tile] - row_max.squeeze(-1))  # [N, block]
    token = tile * block + _first_crossing_ref(p.cumsum(dim=-1), p, rest.unsqueeze(1))
    return torch.where(temperature > 0, token, logits.float().argmax(dim=-1))
