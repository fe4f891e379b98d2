"""The Triton GEMM (kernels/triton_gemm.py) against float32 torch references.

On the CPU by Triton's interpreter (run it as tests/kernels/test_fp8_kv_interpret.py's docstring says:
`TRITON_INTERPRET=1 PYTHONPATH=src:/tmp/triton python -m pytest tests/kernels/test_triton_gemm.py`), on a GPU
by the marked tests (bf16 against cuBLAS, FP8 against `torch._scaled_mm`, and a CUDA-graph replay).
The interpreter's bf16 `tl.dot` is wrong (for every kernel), so its 16-bit cases run at fp16 and
float32 -- the same kernel, another element type; its FP8 cases take random e4m3 bytes directly (the
interpreter's float-to-fp8 cast does not round to nearest even, so nothing is quantized under it).
Without Triton everything but the reference checks skips. With Triton and without the interpreter
(`PYTHONPATH=src:/tmp/triton python -m pytest tests/kernels/test_triton_gemm.py -k sm90`), every M bucket's
config is compiled for an H100 (sm_90, through ptxas, no GPU needed): the GPU's own code, checked for
tensor-core dots (wgmma from 64 rows), 16-byte loads, a software pipeline of `num_stages` and shared memory
that fits.
"""

from __future__ import annotations

import os

import pytest
import torch

from conveyor.kernels.fp8_linear import fp8_linear, quantize_weight_fp8
from conveyor.kernels.fp8_quant import FP8_DTYPE
from conveyor.kernels.triton_compat import HAS_TRITON
from conveyor.kernels import triton_gemm as triton_gemm_module
from conveyor.kernels.triton_gemm import (
    GemmConfig,
    pick_config,
    triton_fp8_gemm,
    triton_fp8_gemm_ref,
    triton_fp8_linear,
    triton_gemm,
    triton_gemm_ref,
)

INTERPRET = HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"
CUDA = HAS_TRITON and torch.cuda.is_available()
interpreted = pytest.mark.skipif(not INTERPRET, reason="needs Triton's interpreter: TRITON_INTERPRET=1 with triton importable")
on_gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA and Triton")
SMALL = GemmConfig(16, 32, 32)
"""A small tile for the interpreter: several N tiles and K steps even at N, K = 64."""


def random_fp8(shape: tuple[int, int], seed: int, device: str = "cpu") -> torch.Tensor:
    """[shape] e4m3 of random bytes, NaN codes (S.1111.111) replaced by a normal value."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x30
    codes[(codes & 0x78) >= 0x58] &= 0xC7  # exponents above 2^4 -> smaller: sums stay far from overflow
    return codes.view(FP8_DTYPE).to(device)


def scales(device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor(0.037, dtype=torch.float32, device=device),
            torch.tensor(0.0021, dtype=torch.float32, device=device))


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30)).item()


def test_the_m_buckets_widen_with_m() -> None:
    for fp8 in (False, True):
        tiles = [pick_config(m, fp8).block_m for m in (1, 16, 17, 64, 65, 256, 257, 16384)]
        assert tiles == sorted(tiles) and tiles[0] == 16 and pick_config(1 << 40, fp8).block_m == 128


def test_the_fp8_reference_is_the_dequantized_product() -> None:
    x_q, w_q = random_fp8((5, 32), 0), random_fp8((16, 32), 1)
    s_x, s_w = scales()
    ref = triton_fp8_gemm_ref(x_q, w_q, s_x, s_w, out_dtype=torch.float32)
    assert torch.allclose(ref, (x_q.float() * s_x) @ (w_q.float() * s_w).t(), rtol=1e-5, atol=1e-6)


@interpreted
@pytest.mark.parametrize("rows", [1, 3, 17, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_interpreted_16bit_gemm_matches_float32(rows: int, dtype: torch.dtype, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    weight = (torch.randn(80, 96, generator=gen) * 0.1).to(dtype)
    bias = torch.randn(80, generator=gen).to(dtype) if with_bias else None
    out = triton_gemm(x, weight, bias, config=SMALL if rows < 256 else None)
    assert out.shape == (rows, 80) and out.dtype == dtype
    assert relative_error(out, triton_gemm_ref(x, weight, bias)) < (2e-3 if dtype == torch.float16 else 1e-5)


@interpreted
@pytest.mark.parametrize("rows", [1, 3, 17, 256])
@pytest.mark.parametrize("with_bias", [False, True])
def test_interpreted_fp8_gemm_applies_both_scales(rows: int, with_bias: bool) -> None:
    x_q, w_q = random_fp8((rows, 64), rows), random_fp8((48, 64), 100 + rows)
    s_x, s_w = scales()
    bias = torch.linspace(-1, 1, 48) if with_bias else None
    out = triton_fp8_gemm(x_q, w_q, s_x, s_w, bias, out_dtype=torch.float32, config=SMALL if rows < 256 else None)
    ref = triton_fp8_gemm_ref(x_q, w_q, s_x, s_w, bias, out_dtype=torch.float32)
    assert out.shape == (rows, 48) and relative_error(out, ref) < 1e-5


@interpreted
def test_interpreted_k_tail_and_n_tail_are_masked() -> None:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, 48, generator=gen)  # K = 48: a 32-wide K step leaves a tail of 16
    weight = torch.randn(48, 48, generator=gen)  # N = 48: a 32-wide N tile leaves a tail of 16
    out = triton_gemm(x, weight, config=SMALL)
    assert relative_error(out, triton_gemm_ref(x, weight)) < 1e-5


@interpreted
def test_interpreted_bucket_configs_and_an_empty_batch() -> None:
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(128, 256, generator=gen).half()
    for rows in (1, 40):  # the first two M buckets' own tiles
        x = torch.randn(rows, 256, generator=gen).half()
        assert relative_error(triton_gemm(x, weight), triton_gemm_ref(x, weight)) < 2e-3
    assert triton_gemm(torch.empty(0, 256).half(), weight).shape == (0, 128)


def compile_for_sm90(config: GemmConfig, fp8: bool, even_k: bool) -> tuple[str, int]:
    """(TTGIR, shared bytes) of the kernel compiled for sm_90 as a launch on 16-byte aligned operands sees it."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    kernel = triton_gemm_module._gemm_kernel
    element = "fp8e4nv" if fp8 else "bf16"
    types = [f"*{element}", f"*{element}", "*bf16", "*bf16", "*fp32", "*fp32"] + ["i32"] * 6
    constants = {"HAS_BIAS": True, "HAS_SCALES": fp8, "EVEN_K": even_k,
                 "BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "BLOCK_K": config.block_k}
    signature = {**dict(zip(kernel.arg_names, types)), **{name: "constexpr" for name in constants}}
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(len(types)) if kernel.arg_names[i] != "M"}
    compiled = compile(ASTSource(kernel, signature, constants, aligned), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": config.num_warps, "num_stages": config.num_stages})
    return compiled.asm["ttgir"], compiled.metadata.shared


@pytest.mark.skipif(not HAS_TRITON or INTERPRET, reason="needs Triton without its interpreter (compiles, no GPU needed)")
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("rows", [1, 64, 256, 16384])
def test_bucket_configs_compile_for_sm90_pipelined(fp8: bool, rows: int) -> None:
    config = pick_config(rows, fp8)
    ttgir, shared = compile_for_sm90(config, fp8, even_k=rows != 64)  # one bucket with the masked K tail
    wgmma = config.block_m >= 64
    assert f"nvidia_mma<{{versionMajor = {3 if wgmma else 2}" in ttgir  # wgmma, else mma.sync
    assert ttgir.count("ttg.async_copy_global_to_local") == 2 * config.num_stages  # x and W: prologue + loop
    vector = 8 if not fp8 else 16  # elements in 16 bytes: both operands load 16-byte vectors along K
    assert f"sizePerThread = [1, {vector}]" in ttgir and f"sizePerThread = [{vector}, 1]" in ttgir
    tile_bytes = (config.block_m + config.block_n) * config.block_k * (1 if fp8 else 2)
    buffers = config.num_stages if wgmma else config.num_stages - 1  # wgmma keeps one more tile in flight
    assert shared == buffers * tile_bytes <= 227 * 1024  # the H100's shared memory per block


def test_shapes_that_are_not_multiples_of_16_are_refused() -> None:
    with pytest.raises(AssertionError, match="multiples of 16"):
        triton_gemm(torch.zeros(2, 40), torch.zeros(24, 40))


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("rows", [1, 3, 17, 256, 1024])
@pytest.mark.parametrize("k, n", [(4096, 6144), (14336, 4096)])
def test_gpu_bf16_gemm_matches_cublas(rows: int, k: int, n: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, k, generator=gen, device="cuda").bfloat16()
    weight = (torch.randn(n, k, generator=gen, device="cuda") * 0.02).bfloat16()
    bias = torch.randn(n, generator=gen, device="cuda").bfloat16()
    ref = triton_gemm_ref(x, weight, bias).float()
    out = triton_gemm(x, weight, bias)
    # both round once to bf16 from float32 sums: within two bf16 steps of the float32 result, as cuBLAS
    assert relative_error(out, ref) < 8e-3 and relative_error(x @ weight.t() + bias, ref) < 8e-3


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("rows", [1, 3, 17, 256, 1024])
def test_gpu_fp8_linear_matches_scaled_mm(rows: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 4096, generator=gen, device="cuda").bfloat16()
    weight_q, weight_scale = quantize_weight_fp8(torch.randn(6144, 4096, generator=gen, device="cuda") * 0.02)
    bias = torch.randn(6144, generator=gen, device="cuda").bfloat16()
    theirs = fp8_linear(x, weight_q, weight_scale, bias)
    ours = triton_fp8_linear(x, weight_q, weight_scale, bias)
    assert ours.dtype == torch.bfloat16 and relative_error(ours, theirs.float()) < 8e-3


@pytest.mark.gpu
@on_gpu
def test_gpu_kernels_replay_in_a_cuda_graph() -> None:
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    weight = (torch.randn(1024, 4096, device="cuda") * 0.02).bfloat16()
    weight_q, weight_scale = quantize_weight_fp8(weight)
    triton_gemm(x, weight), triton_fp8_linear(x, weight_q, weight_scale)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_bf16 = triton_gemm(x, weight)
        out_fp8 = triton_fp8_linear(x, weight_q, weight_scale)
    x.mul_(3.0)  # new values: the replay must recompute the activation scale on the device
    graph.replay()
    assert relative_error(out_bf16, triton_gemm_ref(x, weight).float()) < 8e-3
    assert relative_error(out_fp8, fp8_linear(x, weight_q, weight_scale).float()) < 8e-3
