"""Dynamic per-tensor FP8 quantization (kernels/fp8_quant.py): the two Triton passes give the torch
path's scale and bits. On the CPU by Triton's interpreter (how to run it: tests/kernels/test_fp8_kv_interpret.py's
docstring), on a GPU by the marked tests. The interpreter's float-to-fp8 cast rounds neither ties to even
nor across a binade, so its cases quantize values e4m3 holds exactly (random e4m3 bytes times a power of
two: x / scale is then exact); the GPU cases are random normal activations."""

from __future__ import annotations

import os

import pytest
import torch

from conveyor.kernels.fp8_quant import FP8_DTYPE, quantize_fp8_dynamic, quantize_fp8_dynamic_ref
from conveyor.kernels.triton_compat import HAS_TRITON

INTERPRET = HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"
CUDA = HAS_TRITON and torch.cuda.is_available()


def exact_activation(num_elements: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """[num_elements] of e4m3-representable values times 2^-3, with +-448 among them (max|x| = 56)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (num_elements,), generator=gen, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x10  # e4m3fn's NaNs (S.1111.111) -> a normal value
    values = codes.view(FP8_DTYPE).float()
    values[num_elements // 2] = -448.0
    return (values * 0.125).to(dtype)


def test_the_reference_is_fp8_linears_torch_path() -> None:
    x = exact_activation(1000, torch.bfloat16)
    x_q, scale = quantize_fp8_dynamic_ref(x)
    assert scale.item() == 56.0 / 448.0 and x_q.dtype == FP8_DTYPE
    assert torch.equal(x_q.float() * scale, x.float())  # exact by construction


def test_an_all_zero_input_takes_the_floor_scale() -> None:
    x_q, scale = quantize_fp8_dynamic_ref(torch.zeros(64, dtype=torch.bfloat16))
    assert scale.item() > 0 and not x_q.float().any()


def test_an_empty_input_takes_the_floor_scale_like_the_triton_path() -> None:
    zero_scale = quantize_fp8_dynamic_ref(torch.zeros(64, dtype=torch.bfloat16))[1]
    x_q, scale = quantize_fp8_dynamic_ref(torch.empty(3, 0, dtype=torch.bfloat16))
    assert torch.equal(scale, zero_scale) and x_q.shape == (3, 0) and x_q.dtype == FP8_DTYPE


def _same(x: torch.Tensor) -> None:
    x_q, scale = quantize_fp8_dynamic(x)
    ref_q, ref_scale = quantize_fp8_dynamic_ref(x)
    assert torch.equal(scale.cpu(), ref_scale.cpu()), (scale, ref_scale)
    assert x_q.shape == x.shape and x_q.dtype == FP8_DTYPE
    assert torch.equal(x_q.view(torch.uint8).cpu(), ref_q.view(torch.uint8).cpu())


@pytest.mark.skipif(not INTERPRET, reason="needs Triton's interpreter: TRITON_INTERPRET=1 with triton importable")
@pytest.mark.parametrize("num_elements", [1, 4095, 4096, 3 * 4096 + 17])  # one block, its edge, a ragged last
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interpreted_passes_give_the_torch_bits(num_elements: int, dtype: torch.dtype) -> None:
    _same(exact_activation(num_elements, dtype).reshape(1, -1))


@pytest.mark.skipif(not INTERPRET, reason="needs Triton's interpreter: TRITON_INTERPRET=1 with triton importable")
def test_interpreted_zero_input_gives_the_floor_scale_and_zeros() -> None:
    _same(torch.zeros(5000, dtype=torch.float32))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA and Triton")
@pytest.mark.parametrize("shape", [(1, 4096), (7, 4096), (256, 14336), (4096, 4096), (3, 0)])
def test_gpu_passes_give_the_torch_bits_on_normal_activations(shape: tuple[int, int]) -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = (torch.randn(shape, generator=gen, device="cuda") * 3.0).to(torch.bfloat16)
    if x.numel():
        x[0, 0] = 1e4  # an outlier: everything else lands far below the max
    _same(x)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA and Triton")
def test_gpu_passes_replay_in_a_cuda_graph() -> None:
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    quantize_fp8_dynamic(x)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x_q, scale = quantize_fp8_dynamic(x)
    x.mul_(2.0)  # new values in the captured input: the replay must recompute the scale
    graph.replay()
    ref_q, ref_scale = quantize_fp8_dynamic_ref(x)
    assert torch.equal(scale, ref_scale) and torch.equal(x_q.view(torch.uint8), ref_q.view(torch.uint8))
