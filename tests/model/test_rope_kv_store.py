"""The model side of the rope kernels' K/V store: `LlamaAttention.stores_kv_in_rope` (with
`Attention.accepts_kv_from_rope`) picks it only on CUDA, fused kernels on, the triton backend and store_kv's
cache layout, and a step whose K/V the rope stored skips `write_kv` and attends the same.

CPU only: the decision reads tensors' device, dtype, shape and strides, so CPU tensors that say they are on
CUDA (`OnCuda`) stand in, and the fused kernel is replaced by its torch reference.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cuda_stand_in import OnCuda

from conveyor.kernels.fp8_kv import UNIT_KV_SCALES
from conveyor.kernels.qk_norm_rope import qk_norm_rope_store_kv_ref
from conveyor.model import layers
from conveyor.model.attention import TorchAttentionBackend, kv_cache_shape
from conveyor.model.attention_metadata import SequenceSpec, build_attention_metadata
from conveyor.model.llama import LlamaAttention
from conveyor.model.qwen3 import Qwen3Attention
from conveyor.model.registry import ModelArchConfig

HEADS, KV_HEADS, HEAD_DIM, BLOCKS, BLOCK_SIZE = 4, 2, 16, 8, 4


def _config(head_dim: int = HEAD_DIM) -> ModelArchConfig:
    return ModelArchConfig(architecture="Qwen3ForCausalLM", hidden_size=32, num_hidden_layers=1,
                           num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=head_dim,
                           intermediate_size=64, vocab_size=16)


class _NamedTriton(TorchAttentionBackend):
    """A backend the decision reads as "triton" (the real one needs Triton to import)."""

    name = "triton"


def _decide(cls: type[LlamaAttention], *, backend: Any = None, cuda: bool = True, dtype: torch.dtype = torch.bfloat16,
            cache_dtype: torch.dtype | None = None, cache_heads: int = KV_HEADS, head_dim: int = HEAD_DIM,
            fused: bool = True) -> bool:
    """`stores_kv_in_rope` of a fresh layer for one decode-sized step of 3 tokens."""
    layer = cls(_config(head_dim), backend or _NamedTriton()).to(dtype)
    layer.fused_launches = fused
    qkv = torch.zeros(3, (HEADS + 2 * KV_HEADS) * head_dim, dtype=dtype)
    q, k, v = (t.unflatten(-1, (-1, head_dim)) for t in qkv.split(layer.shard_sizes(), dim=-1))
    cos = torch.zeros(3, head_dim, dtype=dtype)
    cache = torch.zeros(kv_cache_shape(BLOCKS, BLOCK_SIZE, cache_heads, head_dim), dtype=cache_dtype or dtype)
    wrap = OnCuda if cuda else (lambda t: t)
    return layer.stores_kv_in_rope(*(wrap(t) for t in (q, k, v, cos, cache)))  # type: ignore[arg-type]


@pytest.mark.parametrize("cls", [LlamaAttention, Qwen3Attention])
def test_the_fused_store_is_picked_only_where_it_applies(cls: type[LlamaAttention],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layers, "HAS_TRITON", True)  # the fused kernels "run" here
    assert _decide(cls)
    assert _decide(cls, cache_dtype=torch.float8_e4m3fn)  # an FP8 cache: the store quantizes as store_kv
    assert _decide(cls, dtype=torch.float16)
    assert not _decide(cls, backend=TorchAttentionBackend())  # its write_kv is not store_kv
    assert not _decide(cls, cuda=False)  # CPU: today's path
    assert not _decide(cls, fused=False)  # set_fused_launches(False)
    assert not _decide(cls, dtype=torch.float32)  # the fused kernels are 16-bit
    assert not _decide(cls, cache_dtype=torch.float32)  # a cast store_kv would do, the rope kernel does not
    assert not _decide(cls, cache_heads=2 * KV_HEADS)  # a cache not of this layer's (shard's) heads
    assert not _decide(cls, head_dim=12)  # rope is not one kernel
    monkeypatch.setattr(layers, "HAS_TRITON", False)
    assert not _decide(cls)


def _step(layer: Qwen3Attention, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of 3 prefill tokens and a decode -> (output, the KV cache)."""
    metadata = build_attention_metadata([SequenceSpec(3, 3, [0]), SequenceSpec(1, 6, [1, 2])], BLOCK_SIZE, "cpu")
    cache = torch.zeros(kv_cache_shape(BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM))
    positions = torch.tensor([0, 1, 2, 5])
    angles = positions[:, None].float() * torch.linspace(0.1, 1.0, HEAD_DIM // 2)[None, :]
    rope = (torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1))
    with torch.no_grad():
        return layer(x, rope, cache, metadata), cache


def test_a_step_whose_rope_stored_kv_skips_write_kv_and_attends_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    layer = Qwen3Attention(_config(), TorchAttentionBackend())
    with torch.no_grad():
        layer.q_norm.weight.uniform_(0.5, 1.5)
        layer.k_norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(4, 32)
    want_out, want_cache = _step(layer, x)

    def rope_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                       kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        weights = (layer.q_norm.weight, layer.k_norm.weight)
        new_q, new_k = qk_norm_rope_store_kv_ref(q, k, weights, rope, layer.q_norm.eps, v, (kv_cache[0], kv_cache[1]),
                                                 slot_mapping, UNIT_KV_SCALES)
        q.copy_(new_q)
        k.copy_(new_k)

    def no_write(*args: object) -> None:
        raise AssertionError("write_kv ran although the rope stored K/V")

    monkeypatch.setattr(layer, "stores_kv_in_rope", lambda *args: True)
    monkeypatch.setattr(layer, "rope_and_store_kv_", rope_and_store)
    monkeypatch.setattr(layer.attn.backend, "write_kv", no_write)
    got_out, got_cache = _step(layer, x)
    torch.testing.assert_close(got_cache, want_cache, rtol=1e-5, atol=1e-6)  # the CPU kernels sum in another order
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-6)
