"""prefill_linear: oneDNN's GEMM where it applies, F.linear otherwise; the same product either way."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conveyor.kernels import cpu_gemm
from conveyor.kernels.cpu_gemm import onednn_available, prefill_linear


@pytest.mark.parametrize("shape", [(300, 576, 1536), (257, 1536, 576), (1, 64, 8), (40, 32, 100)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64_product(shape: tuple[int, int, int], with_bias: bool) -> None:
    rows, k, n = shape
    gen = torch.Generator().manual_seed(rows + k)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    out = prefill_linear(x, w, bias)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    # float32 accumulation over k terms of size ~1: errors ~ sqrt(k) * 2^-24 * |terms|
    assert torch.allclose(out.double(), exact, rtol=0, atol=1e-5 * k**0.5 * 4)


def test_strided_input_is_made_contiguous() -> None:
    x = torch.randn(600, 64)[::2]
    w = torch.randn(32, 64)
    assert torch.allclose(prefill_linear(x, w), F.linear(x, w), atol=1e-4)


def test_other_dtypes_fall_back_to_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[torch.dtype] = []
    real = F.linear
    monkeypatch.setattr(cpu_gemm.F, "linear", lambda x, w, b=None: calls.append(x.dtype) or real(x, w, b))
    x, w = torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(4, 16, dtype=torch.bfloat16)
    out = prefill_linear(x, w)
    assert calls == [torch.bfloat16] and out.dtype == torch.bfloat16


def test_float32_uses_onednn_when_torch_has_it(monkeypatch: pytest.MonkeyPatch) -> None:
    if not onednn_available():
        pytest.skip("this torch has no MKL-DNN")
    monkeypatch.setattr(cpu_gemm.F, "linear", lambda *a: pytest.fail("F.linear ran for float32"))
    assert prefill_linear(torch.randn(8, 16), torch.randn(4, 16)).shape == (8, 4)
