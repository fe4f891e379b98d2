"""GGUF block matmuls on the CPU (kernels/cpu/gguf_matmul.c): shape-checking wrappers and torch references.

The model: a weight [N, K] is kept in GGUF blocks of 32 along K and multiplied with float32
activations without being dequantized in memory: Q4 (Q4_1's w = d q + m, q in 0..15; Q4_0 is the
same with m = -8 d) and Q8_0 (w = d q, q int8). The wrappers check shapes, dtypes and contiguity,
then call the C kernel; `*_ref` compute the same from the dequantized weight in torch (the tests'
reference). Layout of the tensors:
    Q4:   qweight [N, K/2] uint8 (per block of 32: byte j = element j | element j + 16 << 4),
          scales [N, K/32] float32, mins [N, K/32] float32
    Q8_0: qweight [N, K] int8, scales [N, K/32] float32
"""

from __future__ import annotations

import torch

from conveyor.kernels.cpu_build import cpu_kernels

BLOCK = 32
"""Weights per GGUF block (along K) for every type these kernels take."""


def _check_q4(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> tuple[int, int]:
    n, half_k = qweight.shape
    k = 2 * half_k
    assert qweight.dtype == torch.uint8 and k % BLOCK == 0, f"qweight {qweight.dtype} {tuple(qweight.shape)}"
    for t in (scales, mins):
        assert t.dtype == torch.float32 and tuple(t.shape) == (n, k // BLOCK), f"{t.dtype} {tuple(t.shape)}"
    assert all(t.is_contiguous() and t.device.type == "cpu" for t in (qweight, scales, mins))
    return n, k


def _check_q8(qweight: torch.Tensor, scales: torch.Tensor) -> tuple[int, int]:
    n, k = qweight.shape
    assert qweight.dtype == torch.int8 and k % BLOCK == 0, f"qweight {qweight.dtype} {tuple(qweight.shape)}"
    assert scales.dtype == torch.float32 and tuple(scales.shape) == (n, k // BLOCK), f"scales {tuple(scales.shape)}"
    assert all(t.is_contiguous() and t.device.type == "cpu" for t in (qweight, scales))
    return n, k


def _check_x(x: torch.Tensor, k: int) -> None:
    assert x.dim() == 2 and x.shape[1] == k, f"x {tuple(x.shape)} for K = {k}"
    assert x.dtype == torch.float32 and x.is_contiguous() and x.device.type == "cpu", "x: contiguous CPU float32"


def _check_status(status: int, x: torch.Tensor) -> None:
    if status != 0:  # the kernel's packed copy of x: [M, K] float32
        raise MemoryError(f"the GGUF block matmul could not allocate {x.numel() * 4} bytes for its packed input")


def q4_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 -> [M, N] float32 = x @ W^T for a Q4 weight W [N, K]."""
    n, k = _check_q4(qweight, scales, mins)
    _check_x(x, k)
    out = torch.empty((x.shape[0], n), dtype=torch.float32)
    status = cpu_kernels().q4_matmul(x.data_ptr(), x.shape[0], k, qweight.data_ptr(), scales.data_ptr(),
                                     mins.data_ptr(), n, out.data_ptr(), torch.get_num_threads())
    _check_status(status, x)
    return out


def q8_0_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 -> [M, N] float32 = x @ W^T for a Q8_0 weight W [N, K]."""
    n, k = _check_q8(qweight, scales)
    _check_x(x, k)
    out = torch.empty((x.shape[0], n), dtype=torch.float32)
    status = cpu_kernels().q8_0_matmul(x.data_ptr(), x.shape[0], k, qweight.data_ptr(), scales.data_ptr(),
                                       n, out.data_ptr(), torch.get_num_threads())
    _check_status(status, x)
    return out


def _dequantized_out(n: int, k: int, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty((n, k), dtype=torch.float32)
    assert out.dtype == torch.float32 and out.is_contiguous() and tuple(out.shape) == (n, k), f"out {tuple(out.shape)}"
    return out


def q4_dequantize(
    qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The Q4 weight as float32 [N, K] (one pass, for prefill-sized inputs that go to BLAS), into
    `out` when given (a reused buffer: a fresh multi-megabyte one is page-faulted in on every call)."""
    n, k = _check_q4(qweight, scales, mins)
    out = _dequantized_out(n, k, out)
    cpu_kernels().q4_dequantize(qweight.data_ptr(), scales.data_ptr(), mins.data_ptr(), n, k,
                                out.data_ptr(), torch.get_num_threads())
    return out


def q8_0_dequantize(qweight: torch.Tensor, scales: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The Q8_0 weight as float32 [N, K] (into `out` when given)."""
    n, k = _check_q8(qweight, scales)
    out = _dequantized_out(n, k, out)
    cpu_kernels().q8_0_dequantize(qweight.data_ptr(), scales.data_ptr(), n, k, out.data_ptr(),
                                  torch.get_num_threads())
    return out


def q4_dequantize_ref(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """Torch reference of `q4_dequantize`: unpack the nibbles, w = d q + m per block."""
    n = qweight.shape[0]
    packed = qweight.view(n, -1, BLOCK // 2)  # [N, K/32, 16]
    quants = torch.cat((packed & 0x0F, packed >> 4), dim=-1).float()  # [N, K/32, 32]
    return (quants * scales[..., None] + mins[..., None]).reshape(n, -1)


def q8_0_dequantize_ref(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Torch reference of `q8_0_dequantize`: w = d q per block."""
    n = qweight.shape[0]
    return (qweight.view(n, -1, BLOCK).float() * scales[..., None]).reshape(n, -1)


def q4_matmul_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    return x @ q4_dequantize_ref(qweight, scales, mins).T


def q8_0_matmul_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x @ q8_0_dequantize_ref(qweight, scales).T
