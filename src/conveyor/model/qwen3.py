"""Qwen3 (dense): the Llama layout plus an RMSNorm over each head of q and k before rope.

Everything else (GQA, rope, gated MLP, tied embeddings on the small sizes, no qkv bias) is shared
with llama.py; `head_dim` comes from the config and need not equal hidden_size / num_heads.
"""

from __future__ import annotations

import torch

from conveyor.kernels.qk_norm_rope import qk_norm_rope_
from conveyor.model.attention import AttentionBackend
from conveyor.model.layers import RMSNorm, use_fused_kernels
from conveyor.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from conveyor.model.registry import ModelArchConfig


class Qwen3Attention(LlamaAttention):
    """LlamaAttention with per-head q_norm / k_norm (weights [head_dim], shared by all heads)."""

    fused_launches = True
    """Norm and rope of q/k in one launch where the fused kernels run, which also stores K/V where the attention
    allows it (LlamaAttention's `stores_kv_in_rope`); `LlamaForCausalLM.set_fused_launches` turns both off."""

    def __init__(self, config: ModelArchConfig, backend: AttentionBackend) -> None:
        super().__init__(config, backend)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, d], k [T, kvh, d]: normalized over d."""
        return self.q_norm(q), self.k_norm(k)

    def position_qk(self, q: torch.Tensor, k: torch.Tensor,
                    rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, d], k [T, kvh, d] normalized, then rotated: one in-place kernel (kernels/qk_norm_rope.py,
        the norm and rope kernels' rounding steps) where it applies, the two steps elsewhere."""
        cos, sin = rope
        if self.fused_launches and self._fusable(q, k, cos):
            qk_norm_rope_(q, k, self.q_norm.weight, self.k_norm.weight, cos, sin, self.q_norm.eps)
            return q, k
        return super().position_qk(q, k, rope)

    def rope_and_store_kv_(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """`position_qk` in place, and k (normalized, rotated) and v [T, kvh, d] into kv_cache at slot_mapping
        [T], one launch (kernels/qk_norm_rope.py); only where `stores_kv_in_rope` said so."""
        qk_norm_rope_(q, k, self.q_norm.weight, self.k_norm.weight, *rope, self.q_norm.eps, value=v,
                      key_cache=kv_cache[0], value_cache=kv_cache[1], slot_mapping=slot_mapping,
                      kv_scales=self.attn.kv_scales)

    def _fusable(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor) -> bool:
        head_dim = q.shape[-1]
        same_dtype = q.dtype == k.dtype == cos.dtype == self.q_norm.weight.dtype == self.k_norm.weight.dtype
        return (use_fused_kernels(q) and same_dtype and self.q_norm.eps == self.k_norm.eps
                and head_dim & (head_dim - 1) == 0 and q.stride(-1) == 1 and k.stride(-1) == 1)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention
    cpu_stack_compatible = False  # the q/k norms are not in kernels/cpu/decoder_stack.c


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer
