"""The model side of split-K (kernels/splitk_linear.py): `Linear.partial_sums` takes only plain 16-bit CUDA
projections that `splitk_plan` covers, with the fused launches on; the residual-stream stack hands o_proj's and
down_proj's partials to the next norm (and the final one), which adds them up; the plain loop never asks.

CPU only: the decision reads tensors' device, dtype, shape and strides, so CPU tensors that say they are on
CUDA (`OnCuda`) stand in and the kernel launch is recorded, not run; the wiring runs the torch reference.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cuda_stand_in import OnCuda

from conveyor.kernels.fp8_quant import FP8_DTYPE
from conveyor.kernels.splitk_linear import PartialSums, SplitKPlan, splitk_linear_ref
from conveyor.model import layers
from conveyor.model.attention import TorchAttentionBackend, kv_cache_shape
from conveyor.model.attention_metadata import SequenceSpec, build_attention_metadata
from conveyor.model.layers import Linear, split_k_partials
from conveyor.model.parallel_layers import ColumnParallelLinear, RowParallelLinear, Span, TensorParallelGroup
from conveyor.model.qwen3 import Qwen3ForCausalLM
from conveyor.model.registry import ModelArchConfig

O_SHAPE, DOWN_SHAPE = (2048, 1024), (3072, 1024)  # Qwen3-0.6B's (in, out): o_proj, down_proj
BLOCKS, BLOCK_SIZE = 8, 4


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, SplitKPlan]]:
    """The fused kernels "run" (HAS_TRITON) and each split-K launch is recorded as (silu, plan)."""
    recorded: list[tuple[bool, SplitKPlan]] = []

    def record(a: Any, weight: torch.Tensor, silu: bool, plan: SplitKPlan) -> PartialSums:
        recorded.append((silu, plan))
        return PartialSums(torch.zeros(1, a.shape[0], weight.shape[0]), a.dtype)

    monkeypatch.setattr(layers, "HAS_TRITON", True)
    monkeypatch.setattr(layers, "splitk_linear", record)
    return recorded


def _decide(proj: Linear, rows: int = 256, silu: bool = False, cuda: bool = True,
            dtype: torch.dtype = torch.bfloat16, x: torch.Tensor | None = None) -> PartialSums | None:
    """`partial_sums` of proj for an input of `rows` rows (silu: gate_up, twice as wide)."""
    width = proj.weight.shape[1] * (2 if silu else 1)
    x = torch.zeros(rows, width, dtype=dtype) if x is None else x
    return proj.partial_sums(OnCuda(x) if cuda else x, silu)  # type: ignore[arg-type]


def _proj(shape: tuple[int, int], bias: bool = False) -> Linear:
    return Linear(*shape, bias=bias).to(torch.bfloat16)


def test_qwen3s_o_and_down_projections_split_k(launches: list[tuple[bool, SplitKPlan]]) -> None:
    assert isinstance(_decide(_proj(O_SHAPE)), PartialSums)
    assert isinstance(_decide(_proj(DOWN_SHAPE), silu=True), PartialSums)
    assert isinstance(_decide(_proj(O_SHAPE), rows=1), PartialSums)
    half = Linear(*O_SHAPE, bias=False).to(torch.float16)
    assert isinstance(_decide(half, rows=512, dtype=torch.float16), PartialSums)
    assert [(silu, plan.splits) for silu, plan in launches] == [(False, 4), (True, 8), (False, 4), (False, 4)]


def test_everything_else_keeps_its_usual_path(launches: list[tuple[bool, SplitKPlan]],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    assert _decide(_proj(O_SHAPE), cuda=False) is None  # CPU
    assert _decide(_proj(O_SHAPE), rows=513) is None  # prefill-sized: cuBLAS
    assert _decide(_proj((14336, 4096))) is None  # Llama-3.1-8B's down_proj: N > 2,048
    assert _decide(_proj((1024, 2048))) is None  # K < 2 N
    assert _decide(_proj(O_SHAPE, bias=True)) is None
    assert _decide(_proj(O_SHAPE), dtype=torch.float16) is None  # x's dtype is not the weight's
    assert _decide(Linear(*O_SHAPE, bias=False), dtype=torch.float32) is None  # the fused kernels are 16-bit
    assert _decide(_proj(O_SHAPE), x=torch.zeros(256, 2 * O_SHAPE[0], dtype=torch.bfloat16)[:, ::2]) is None
    assert _decide(_proj(O_SHAPE), x=torch.zeros(256, 2 * O_SHAPE[0], dtype=torch.bfloat16)) is None  # not [M, K]
    fp8 = _proj(O_SHAPE)
    fp8.weight = torch.nn.Parameter(fp8.weight.data.to(FP8_DTYPE), requires_grad=False)
    fp8.weight_scale = torch.ones(())
    assert _decide(fp8) is None  # --quantization fp8
    triton_gemm = _proj(O_SHAPE)
    triton_gemm.use_triton_gemm = True
    assert _decide(triton_gemm) is None  # --gemm-backend triton keeps its own GEMM
    switched_off = _proj(O_SHAPE)
    switched_off.fused_launches = False
    assert _decide(switched_off) is None  # set_fused_launches(False)
    monkeypatch.setattr(layers, "HAS_TRITON", False)
    assert _decide(_proj(O_SHAPE)) is None
    assert launches == []


def test_tensor_parallel_shards_keep_their_collectives(launches: list[tuple[bool, SplitKPlan]]) -> None:
    group = TensorParallelGroup(rank=0, world_size=2)
    row = RowParallelLinear(Span(0, O_SHAPE[0]), O_SHAPE[1], bias=False, group=group).to(torch.bfloat16)
    column = ColumnParallelLinear(O_SHAPE[0], (Span(0, O_SHAPE[1]),), bias=False).to(torch.bfloat16)
    assert _decide(row) is None  # its output is one rank's part of the all-reduce's sum
    assert _decide(column) is None
    assert launches == []


def test_a_projection_that_is_no_linear_is_not_asked(launches: list[tuple[bool, SplitKPlan]]) -> None:
    assert split_k_partials(torch.nn.Identity(), OnCuda(torch.zeros(256, 2048, dtype=torch.bfloat16))) is None  # type: ignore[arg-type]
    assert isinstance(split_k_partials(_proj(O_SHAPE), OnCuda(torch.zeros(256, 2048, dtype=torch.bfloat16))),  # type: ignore[arg-type]
                      PartialSums)


def _config() -> ModelArchConfig:
    return ModelArchConfig(architecture="Qwen3ForCausalLM", hidden_size=32, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=64,
                           vocab_size=16)


def _forward(model: Qwen3ForCausalLM) -> torch.Tensor:
    """Hidden rows [4, 32] of 3 prefill tokens and a decode."""
    metadata = build_attention_metadata([SequenceSpec(3, 3, [0]), SequenceSpec(1, 6, [1, 2])], BLOCK_SIZE, "cpu")
    caches = [torch.zeros(kv_cache_shape(BLOCKS, BLOCK_SIZE, 2, 16)) for _ in range(2)]
    with torch.no_grad():
        return model(torch.tensor([1, 5, 7, 3]), torch.tensor([0, 1, 2, 5]), caches, metadata)


def _partials_from_the_reference(model: Qwen3ForCausalLM) -> list[str]:
    """Makes every o_proj and down_proj answer `partial_sums` with the torch reference's 3-split partials;
    returns the list their calls are named into."""
    calls: list[str] = []
    plan = SplitKPlan(16, 16, 16, num_warps=4, num_stages=2, splits=3)
    for name, module in model.named_modules():
        if name.endswith(("o_proj", "down_proj")):
            def reference(x: torch.Tensor, silu: bool = False, _module: Linear = module, _name: str = name) -> PartialSums:
                calls.append(_name.rpartition(".")[2])
                return splitk_linear_ref(x, _module.weight, silu, plan)

            module.partial_sums = reference  # type: ignore[method-assign]
    return calls


def test_the_residual_stream_hands_partials_to_the_next_norms() -> None:
    """o_proj's partials go to the post-attention norm, down_proj's (SwiGLU in the reference's loads) to the next
    layer's input norm and the final norm; their float32 sums are the projections' outputs up to summation order."""
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(_config(), TorchAttentionBackend())
    model.uses_residual_stream = lambda x: True  # type: ignore[method-assign]
    want = _forward(model)
    calls = _partials_from_the_reference(model)
    got = _forward(model)
    assert calls == ["o_proj", "down_proj"] * 2
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_plain_loop_never_asks_for_partials() -> None:
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(_config(), TorchAttentionBackend())
    calls = _partials_from_the_reference(model)
    _forward(model)
    assert calls == []
    model.set_fused_launches(False)
    assert not any(m.fused_launches for m in model.modules() if isinstance(m, Linear))
