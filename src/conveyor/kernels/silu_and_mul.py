"""SwiGLU activation in one launch: out = silu(gate) * up for gate_up = [gate | up] along the last dim.

The model: one program per (row, column block); silu is computed in float32 and rounded to the input
dtype before the product, as eager `F.silu(gate) * up` does (exp may differ in the last fp32 bit).
"""

import torch

from conveyor.kernels.triton_compat import tl, triton


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, num_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < num_cols
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + num_cols + cols, mask=mask, other=0.0)
    g32 = gate.to(tl.float32)
    activated = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype)
    out = (activated.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] -> [T, I]."""
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0 and gate_up.stride(1) == 1, tuple(gate_up.shape)
    num_rows, num_cols = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(num_rows, num_cols, dtype=gate_up.dtype, device=gate_up.device)
    if num_rows > 0:
        block = 1024
        _silu_and_mul_kernel[(num_rows, triton.cdiv(num_cols, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), num_cols, BLOCK=block, num_warps=4,
        )
    return out


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
