"""Inverse-CDF sampling: the reference draws from softmax(logits / T) (CPU); the kernels compute the
reference on their own uniforms by Triton's interpreter (CPU, TRITON_INTERPRET=1) and on the GPU, are
exact argmax at temperature 0, follow the distribution and replay under a CUDA graph (GPU).

The interpreter cases run where Triton is importable (a CPU-only checkout has none):

    pip install --target /tmp/triton triton
    TRITON_INTERPRET=1 PYTHONPATH=src:/tmp/triton python -m pytest -q -p no:cacheprovider \\
        tests/kernels/test_cdf_sample.py
"""

from __future__ import annotations

import os

import pytest
import torch
from sampling_stats import CHI_SQUARE_999, PROBS, chi_square, tempered

from conveyor.kernels.cdf_sample import (
    BLOCK,
    UNIFORM_MAX,
    cdf_sample,
    cdf_sample_ref,
    cdf_sample_supported,
    cdf_uniforms,
)
from conveyor.kernels.triton_compat import HAS_TRITON

gpu = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and Triton")
interpret = pytest.mark.skipif(not HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1",
                               reason="needs Triton's interpreter: TRITON_INTERPRET=1 with triton importable")


def inverse_cdf_float64(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The textbook draw, in float64 over the whole row: the first token whose CDF passes u."""
    probs = torch.softmax(logits.double() / temperature.double().unsqueeze(1), dim=-1)
    cdf = probs.cumsum(dim=-1)
    target = (uniform.double() * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


@pytest.mark.parametrize("block", [4, 8])  # two tiles of 4, or one
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_reference_draws_from_the_tempered_softmax(temperature: float, block: int) -> None:
    num_rows = 20000
    logits = (PROBS.log() + 3.0).expand(num_rows, 8)  # a shift changes nothing
    uniform = torch.rand(num_rows, generator=torch.Generator().manual_seed(int(temperature * 10)))
    tokens = cdf_sample_ref(logits, torch.full((num_rows,), temperature), uniform, block=block)
    assert chi_square(tokens, tempered(PROBS, temperature)) < CHI_SQUARE_999[7]


def test_reference_with_masked_tokens_draws_from_the_rest() -> None:
    num_rows = 20000
    logits = PROBS.log().expand(num_rows, 8).clone()
    logits[:, 1::2] = float("-inf")
    uniform = torch.rand(num_rows, generator=torch.Generator().manual_seed(5))
    tokens = cdf_sample_ref(logits, torch.ones(num_rows), uniform, block=2)  # every tile half masked
    assert (tokens % 2 == 0).all()
    kept = PROBS[0::2] / PROBS[0::2].sum()
    assert chi_square(tokens // 2, kept) < CHI_SQUARE_999[3]


def test_reference_greedy_rows_are_exact_argmax_with_lowest_index_ties() -> None:
    logits = torch.randn(64, 1000).round(decimals=1)  # many ties at the maximum
    logits[3, :] = 2.0  # all tied: column 0
    uniform = torch.rand(64, generator=torch.Generator().manual_seed(0))
    tokens = cdf_sample_ref(logits, torch.zeros(64), uniform, block=128)
    assert torch.equal(tokens, logits.argmax(dim=-1)) and tokens[3] == 0
    first_max = [int((row == row.max()).nonzero()[0]) for row in logits]
    assert tokens.tolist() == first_max


def test_reference_never_picks_minus_inf_even_at_extreme_uniforms() -> None:
    logits = torch.full((4, 16), float("-inf"))
    logits[:, 5] = -50.0  # the only finite token, and a low one, in the second tile of 4
    uniform = torch.tensor([0.0, 1.0, UNIFORM_MAX, 0.5])
    tokens = cdf_sample_ref(logits, torch.tensor([1.0, 1e-2, 1.0, 100.0]), uniform, block=4)
    assert tokens.tolist() == [5, 5, 5, 5]  # the all -inf tiles weigh 0 (no NaN)
    all_masked = torch.full((3, 16), float("-inf"))
    assert cdf_sample_ref(all_masked, torch.tensor([0.0, 1.0, 0.5]), uniform[:3], block=4).tolist() == [0, 0, 0]


def test_reference_uniform_near_0_and_1_picks_the_first_and_last_live_tokens() -> None:
    logits = torch.zeros(4, 1000)
    logits[:, :3] = float("-inf")  # the first live token is 3
    logits[:, 997:] = float("-inf")  # the last is 996
    uniform = torch.tensor([0.0, 1e-9, 1.0, 1.0 - 1e-9])
    tokens = cdf_sample_ref(logits, torch.ones(4), uniform, block=64)
    assert tokens.tolist() == [3, 3, 996, 996]


@pytest.mark.parametrize("vocab_size", [7, 2 * 64 + 3, 1000])
def test_reference_matches_the_float64_inverse_cdf_when_v_is_not_a_multiple_of_block(vocab_size: int) -> None:
    gen = torch.Generator().manual_seed(vocab_size)
    logits = torch.randn(2000, vocab_size, generator=gen) * 3
    temperature = torch.rand(2000, generator=gen) + 0.3
    uniform = torch.rand(2000, generator=gen)
    expected = inverse_cdf_float64(logits, temperature, uniform)
    for block in (64, BLOCK):  # several tiles and a ragged last one, or one tile
        tokens = cdf_sample_ref(logits, temperature, uniform, block=block)
        assert int((tokens != expected).sum()) <= 1  # float32 sums: a u within rounding of a step, rarely


def test_reference_reads_bf16_logits_as_their_float32_values() -> None:
    logits = torch.randn(32, 500).bfloat16()
    uniform = torch.rand(32, generator=torch.Generator().manual_seed(2))
    temperature = torch.rand(32) + 0.1
    temperature[::4] = 0.0
    assert torch.equal(cdf_sample_ref(logits, temperature, uniform),
                       cdf_sample_ref(logits.float(), temperature, uniform))


def test_kernels_are_cuda_only() -> None:
    assert not cdf_sample_supported(torch.device("cpu"))
    seed = torch.zeros(1, dtype=torch.int64)
    launches = (lambda: cdf_sample(torch.zeros(1, 8), torch.ones(1), seed), lambda: cdf_uniforms(1, seed))
    for launch in launches if not HAS_TRITON else ():
        with pytest.raises(RuntimeError, match="needs Triton"):
            launch()


def mixed_batch(num_rows: int, vocab_size: int, dtype: torch.dtype, device: str, seed: int) -> tuple[
        torch.Tensor, torch.Tensor]:
    """Random logits and temperatures, every third row greedy."""
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = (torch.randn(num_rows, vocab_size, generator=gen, device=device) * 3).to(dtype)
    temperature = torch.rand(num_rows, generator=gen, device=device) * 2 + 0.05
    temperature[::3] = 0.0
    return logits, temperature


def seed_on(device: str, seed: int) -> torch.Tensor:
    return torch.tensor([seed], dtype=torch.int64, device=device)


@interpret
@pytest.mark.parametrize("vocab_size", [1000, 5000, 2 * BLOCK + 17, 10000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_interpreted_kernel_computes_the_reference_on_its_uniforms(vocab_size: int, dtype: torch.dtype) -> None:
    logits, temperature = mixed_batch(12, vocab_size, dtype, "cpu", vocab_size)
    seed = seed_on("cpu", 99)
    tokens = cdf_sample(logits, temperature, seed)
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, cdf_sample_ref(logits, temperature, cdf_uniforms(12, seed)))
    assert torch.equal(tokens[::3], logits[::3].float().argmax(dim=-1))


@interpret
def test_interpreted_greedy_rows_take_the_lowest_column_of_a_tie_across_tiles() -> None:
    logits = torch.randn(4, 3 * BLOCK + 5).bfloat16()
    logits[1, [10, BLOCK + 3, 3 * BLOCK + 4]] = 100.0
    logits[2, :] = 1.0  # all tied: column 0
    logits[3, :] = float("-inf")  # all -inf: column 0
    tokens = cdf_sample(logits, torch.zeros(4), seed_on("cpu", 0))
    assert torch.equal(tokens, logits.argmax(dim=-1)) and tokens[1:].tolist() == [10, 0, 0]


@interpret
def test_interpreted_kernel_never_picks_masked_tokens() -> None:
    num_rows, vocab_size = 16, 3 * BLOCK + 11
    logits = torch.randn(num_rows, vocab_size).bfloat16()
    logits[:, 1::2] = float("-inf")
    logits[:, BLOCK:2 * BLOCK] = float("-inf")  # a whole tile masked: weight 0, no NaN
    logits[0, :] = float("-inf")  # a fully masked row: column 0, as torch.argmax
    temperature = torch.full((num_rows,), 5.0)
    seed = seed_on("cpu", 3)
    tokens = cdf_sample(logits, temperature, seed)
    assert tokens[0] == 0 and (tokens[1:] % 2 == 0).all()
    assert not ((tokens >= BLOCK) & (tokens < 2 * BLOCK)).any()
    assert torch.equal(tokens, cdf_sample_ref(logits, temperature, cdf_uniforms(num_rows, seed)))


@interpret
def test_interpreted_kernel_reads_rows_at_any_stride() -> None:
    wide, temperature = mixed_batch(6, 3000, torch.float16, "cpu", 4)
    logits = wide[:, :2500]  # row stride 3000
    seed = seed_on("cpu", 8)
    assert torch.equal(cdf_sample(logits, temperature, seed),
                       cdf_sample_ref(logits, temperature, cdf_uniforms(6, seed)))


@interpret
def test_interpreted_uniforms_are_per_row_and_per_seed() -> None:
    first = cdf_uniforms(64, seed_on("cpu", 1))
    assert torch.equal(first, cdf_uniforms(64, seed_on("cpu", 1)))
    assert (first >= 0).all() and (first <= UNIFORM_MAX).all() and first.unique().numel() == 64
    assert (first != cdf_uniforms(64, seed_on("cpu", 2))).all()


PASS_SIGNATURES = {
    "_cdf_tile_kernel": ({"logits_ptr": "*bf16", "temperature_ptr": "*fp32", "tile_max_ptr": "*fp32",
                          "tile_sum_ptr": "*fp32", "tile_col_ptr": "*i32", "vocab_size": "i32", "stride_row": "i32",
                          "num_tiles": "i32"}, {"BLOCK": BLOCK}),
    "_cdf_pick_kernel": ({"logits_ptr": "*bf16", "temperature_ptr": "*fp32", "seed_ptr": "*i64",
                          "tile_max_ptr": "*fp32", "tile_sum_ptr": "*fp32", "tile_col_ptr": "*i32", "out_ptr": "*i64",
                          "vocab_size": "i32", "stride_row": "i32", "num_tiles": "i32"},
                         {"BLOCK": BLOCK, "TILES_PAD": 64, "U_MAX": UNIFORM_MAX}),
}
"""Both passes' arguments for bf16 logits at V = 151,936 (38 tiles), as `cdf_sample` launches them."""


@pytest.mark.skipif(not HAS_TRITON or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs Triton's compiler (no GPU), which the interpreter replaces")
@pytest.mark.parametrize("name", list(PASS_SIGNATURES))
def test_kernels_compile_for_an_h100_without_a_gpu(name: str) -> None:
    # the interpreter accepts what the compiler may not (a block where a scalar goes): lower to PTX too
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from conveyor.kernels import cdf_sample as module
    signature, constants = PASS_SIGNATURES[name]
    constants = {**constants, "LOG2_E": module.LOG2_E}
    source = ASTSource(getattr(module, name), {**signature, **dict.fromkeys(constants, "constexpr")}, constants)
    ptx = compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    assert "ex2.approx" in ptx and "div.rn.f32" in ptx


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("vocab_size", [128256, 151936])
@pytest.mark.parametrize("num_rows", [1, 256])
def test_kernel_computes_the_reference_on_its_uniforms(num_rows: int, vocab_size: int) -> None:
    logits, temperature = mixed_batch(num_rows, vocab_size, torch.bfloat16, "cuda", 1234)
    temperature[0] = 0.8  # N = 1: a random row
    seed = seed_on("cuda", 1234)
    tokens = cdf_sample(logits, temperature, seed)
    ref = cdf_sample_ref(logits, temperature, cdf_uniforms(num_rows, seed))
    # exp2 and the sums round differently on the GPU: a u within rounding of a step may differ, rarely
    assert int((tokens != ref).sum()) <= 1
    assert torch.equal(tokens[3::3], logits[3::3].argmax(dim=-1))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("vocab_size", [128256, 151936])
def test_kernel_greedy_is_torch_argmax(vocab_size: int) -> None:
    logits = (torch.randn(7, vocab_size, device="cuda") * 4).bfloat16()  # bf16: ties at the max
    logits[-1, [10, 5000, vocab_size - 1]] = 100.0  # a tie across tiles: the lowest column
    tokens = cdf_sample(logits, torch.zeros(7, device="cuda"), seed_on("cuda", 0))
    assert torch.equal(tokens, logits.argmax(dim=-1)) and tokens[-1] == 10





@pytest.mark.gpu
@gpu
def test_kernel_replays_under_a_cuda_graph() -> None:
    logits, temperature = mixed_batch(256, 151936, torch.bfloat16, "cuda", 5)
    seed = seed_on("cuda", 21)
    cdf_sample(logits, temperature, seed)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = cdf_sample(logits, temperature, seed)
    for step_seed in (21, 22):
        seed.fill_(step_seed)  # the seed is read on the device at each replay
        graph.replay()
        assert torch.equal(captured, cdf_sample(logits, temperature, seed_on("cuda", step_seed)))
