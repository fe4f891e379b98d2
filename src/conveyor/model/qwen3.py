"""Qwen3 (dense): the Llama layout plus an RMSNorm over each head of q and k before rope.

Everything else (GQA, rope, gated MLP, tied embeddings on the small sizes, no qkv bias) is shared
with llama.py; `head_dim` comes from the config and need not equal hidden_size / num_heads.
"""

from __future__ import annotations

import torch

from conveyor.model.attention import AttentionBackend
from conveyor.model.layers import RMSNorm
from conveyor.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from conveyor.model.registry import ModelArchConfig


class Qwen3Attention(LlamaAttention):
    """LlamaAttention with per-head q_norm / k_norm (weights [head_dim], shared by all heads)."""

    def __init__(self, config: ModelArchConfig, backend: AttentionBackend) -> None:
        super().__init__(config, backend)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, d], k [T, kvh, d]: normalized over d."""
        return self.q_norm(q), self.k_norm(k)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention
    cpu_stack_compatible = False  # the q/k norms are not in kernels/cpu/decoder_stack.c


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer
