"""Shared layers agree numerically with transformers' implementations."""

from __future__ import annotations

import pytest
import torch

import torch.nn.functional as F

from conveyor.model.layers import (
    CPU_FEW_ROWS, GatedMLP, Linear, RMSNorm, RotaryEmbedding, apply_rotary, padded_rows, rope_inv_freq,
)
from conveyor.model.registry import RopeScaling, RopeType

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

LLAMA3 = RopeScaling(rope_type=RopeType.LLAMA3, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=8192)


def hf_config(scaling: dict | None, theta: float = 500000.0, head_dim: int = 128) -> LlamaConfig:
    params = {"rope_type": "default", "rope_theta": theta} if scaling is None else {**scaling, "rope_theta": theta}
    return LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                       rope_parameters=params, max_position_embeddings=131072)


def test_llama3_inv_freq_matches_transformers() -> None:
    config = hf_config({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    torch.testing.assert_close(rope_inv_freq(128, 500000.0, LLAMA3), expected, atol=0, rtol=0)


@pytest.mark.parametrize("scaling", [None, "llama3"])
def test_rotary_cos_sin_and_rotation_match_transformers(scaling: str | None) -> None:
    ours_scaling = LLAMA3 if scaling else RopeScaling()
    hf_scaling = None if scaling is None else {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}
    hf_rope = modeling_llama.LlamaRotaryEmbedding(hf_config(hf_scaling))
    positions = torch.tensor([0, 1, 7, 100, 8191, 8192, 50000, 131071])
    x = torch.randn(1, 4, len(positions), 128)  # HF layout [batch, heads, seq, d]
    hf_cos, hf_sin = hf_rope(x, positions[None])
    cos, sin = RotaryEmbedding(128, 500000.0, ours_scaling)(positions, torch.float32)
    torch.testing.assert_close(cos, hf_cos[0], atol=0, rtol=0)
    torch.testing.assert_close(sin, hf_sin[0], atol=0, rtol=0)
    hf_q, _ = modeling_llama.apply_rotary_pos_emb(x, x, hf_cos, hf_sin)
    ours = apply_rotary(x[0].transpose(0, 1), cos, sin)  # [T, heads, d]
    torch.testing.assert_close(ours, hf_q[0].transpose(0, 1), atol=1e-6, rtol=1e-6)


def test_rmsnorm_matches_transformers() -> None:
    ours, theirs = RMSNorm(64, 1e-5), modeling_llama.LlamaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        ours.weight.normal_()
        theirs.weight.copy_(ours.weight)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(ours.to(torch.bfloat16)(x), theirs.to(torch.bfloat16)(x), atol=0, rtol=0)


def test_gated_mlp_is_down_of_silu_gate_times_up() -> None:
    mlp = GatedMLP(8, 6)
    x = torch.randn(3, 8)
    gate, up = mlp.gate_up_proj.weight[:6], mlp.gate_up_proj.weight[6:]
    expected = mlp.down_proj(torch.nn.functional.silu(x @ gate.T) * (x @ up.T))
    torch.testing.assert_close(mlp(x), expected)


def test_unknown_rope_type_is_rejected() -> None:
    with pytest.raises(ValueError, match="rope_type 'yarn' is not supported"):
        RopeScaling.parse("yarn")


@pytest.mark.parametrize("num_rows", [1, 3, 8, CPU_FEW_ROWS, CPU_FEW_ROWS + 1])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear_on_either_cpu_path(num_rows: int, bias: bool) -> None:
    torch.manual_seed(num_rows)
    layer = Linear(24, 40, bias=bias)
    x = torch.randn(num_rows, 24)
    out = layer(x)
    assert out.shape == (num_rows, 40) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_padded_rows_rounds_up_to_the_fast_multiples() -> None:
    assert [padded_rows(n) for n in (1, 4, 5, 8, 9, 16, 17, 250)] == [4, 4, 8, 8, 16, 16, 32, 256]
