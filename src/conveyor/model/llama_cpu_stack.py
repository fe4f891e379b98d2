"""The decoder layers of a GGUF Llama on the CPU as one C call per decode step (kernels/decoder_stack_cpu.py).

The model: a decode or verify step of a small model is dominated on the CPU by the ~12 calls per layer
around the kernels (Python, torch dispatch, ctypes), not by the kernels once they are fast; the C
stack runs the same kernels in the same order, so the per-layer modules and this path give the same
bits. It takes a step when the model is on the CPU in float32 with the cpu attention backend (and a
geometry its kernels take), every projection is in GGUF blocks without a bias, the layers compute
no more than decoder_stack.c does (`LlamaDecoderLayer.cpu_stack_compatible`: no per-head q/k norm),
and the step has at most MAX_KERNEL_ROWS tokens -- where the block projections run their few-row
kernel in both paths. Longer steps (prefill), other layouts and other devices run the modules.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from conveyor.kernels.decoder_stack_cpu import (
    BlockWeightTensors,
    LayerTensors,
    PagedQueries,
    StackLayers,
    StackShape,
    StepTensors,
    run_decoder_stack,
)
from conveyor.kernels.paged_attention_cpu import kernel_supports
from conveyor.model.attention import Attention
from conveyor.model.attention_cpu import CPUAttentionPlan, plan_cpu_attention
from conveyor.model.attention_metadata import AttentionMetadata
from conveyor.model.quantized import MAX_KERNEL_ROWS, QuantizedLinear


def _blocks(module: nn.Module) -> BlockWeightTensors | None:
    """A bias-free GGUF-block projection's tensors (None for anything else)."""
    if not isinstance(module, QuantizedLinear) or module.bias is not None:
        return None
    parts = module.weight_parts()
    return BlockWeightTensors(parts.qweight, parts.scales, parts.mins)


class LlamaCPUStack:
    """The C decoder stack of one model's layers, bound to its KV caches on first use."""

    def __init__(self, layers: Sequence[nn.Module], weights: list[list[BlockWeightTensors]], shape: StackShape) -> None:
        self.layers = layers
        self.weights = weights
        """Per layer: qkv, o, gate_up, down."""
        self.shape = shape
        self.attention: Attention = layers[0].self_attn.attn
        self._bound: StackLayers | None = None

    @classmethod
    def for_layers(cls, layers: Sequence[nn.Module]) -> LlamaCPUStack | None:
        """The stack of these decoder layers, or None where they are not all what the C layer computes."""
        if not layers:
            return None
        weights = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            parts = [_blocks(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if (not getattr(layer, "cpu_stack_compatible", False) or any(p is None for p in parts)
                    or any(w.dtype != torch.float32 for w in norms)):
                return None
            weights.append([p for p in parts if p is not None])
        attention: Attention = layers[0].self_attn.attn
        if not kernel_supports(attention.num_heads, attention.num_kv_heads, attention.head_dim):
            return None
        mlp = layers[0].mlp
        shape = StackShape(hidden=mlp.down_proj.out_features, num_heads=attention.num_heads,
                           num_kv_heads=attention.num_kv_heads, head_dim=attention.head_dim,
                           intermediate=mlp.intermediate_size, eps=layers[0].input_layernorm.eps,
                           scale=attention.scale)
        return cls(layers, weights, shape)

    def takes(self, x: torch.Tensor) -> bool:
        """Whether this step runs here (see the module docstring)."""
        return (x.device.type == "cpu" and x.dtype == torch.float32 and 0 < x.shape[0] <= MAX_KERNEL_ROWS
                and self.attention.backend.name == "cpu")

    def run(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_caches: list[torch.Tensor],
            metadata: AttentionMetadata) -> torch.Tensor:
        """x [T, hidden] embeddings -> the last layer's output [T, hidden] (x itself, updated in place)."""
        plan = metadata.backend_plan
        if not isinstance(plan, CPUAttentionPlan):
            plan = metadata.backend_plan = plan_cpu_attention(metadata)
        x = x.contiguous()
        cos, sin = rope
        run_decoder_stack(self._stack(kv_caches), StepTensors(
            x=x, cos=cos.contiguous(), sin=sin.contiguous(), slot_mapping=metadata.slot_mapping.contiguous(),
            short=PagedQueries(plan.short_token_starts, plan.short_num_tokens, plan.short_seq_rows),
            prefill=PagedQueries(plan.prefill_token_starts, plan.prefill_num_tokens, plan.prefill_seq_rows),
            block_tables=plan.block_tables, seq_lens=plan.seq_lens))
        return x

    def _stack(self, kv_caches: list[torch.Tensor]) -> StackLayers:
        """The C view, rebuilt when the KV caches changed (a new initialize_kv_cache)."""
        bound = self._bound
        if bound is None or any(a.data_ptr() != b.kv_cache.data_ptr() for a, b in zip(kv_caches, bound.layers)):
            layers = [LayerTensors(layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                                   *parts, kv_cache)
                      for layer, parts, kv_cache in zip(self.layers, self.weights, kv_caches, strict=True)]
            bound = self._bound = StackLayers(layers, self.shape, MAX_KERNEL_ROWS)
        return bound
