"""Float32 projections of prefill-sized inputs on the CPU through oneDNN instead of torch's default BLAS.

torch's CPU `F.linear` calls MKL's sgemm. On the AMD EPYC (Zen 5) this project's machines now run on,
MKL reached 132-177 GFLOP/s on 2 threads for SmolLM2's projection shapes at 2,048 rows, while oneDNN --
shipped inside torch as MKL-DNN, and the library vLLM's CPU backend computes its linears with -- reached
321-374 (`benchmarks/cpu_gemm.py`; docs/performance.md, CPU head to head, session 6). The op is torch's own
`mkldnn._linear_pointwise` (what inductor's CPU fusions call) on the plain float32 weight: no packing,
so the Q4 path's per-call dequantized buffer works as well as a resident float32 weight. Where torch was
built without MKL-DNN, or for other dtypes, `F.linear` runs. Results differ from MKL's only in the order
of float32 additions.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.cache
def onednn_available() -> bool:
    """Whether this torch has MKL-DNN and its linear op (decided once per process)."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def prefill_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] @ weight[out, in]^T (+ bias) -> [T, out]; oneDNN for float32 CPU tensors, else F.linear."""
    usable = (x.device.type == "cpu" and x.dim() == 2 and x.dtype == torch.float32
              and weight.dtype == torch.float32 and weight.is_contiguous()
              and (bias is None or bias.dtype == torch.float32))
    if not (usable and onednn_available()):
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
