"""The Llama family (Llama 2/3.x, SmolLM2, ...): pre-norm decoder with GQA, rope and a SiLU-gated MLP.

The model computes a flat batch of tokens from many sequences at once (see attention_metadata):
it never sees padding or a batch dimension, so prefill chunks and decodes share every matmul.
`forward` returns hidden states for all tokens; the runner picks the rows it samples from and
calls `compute_logits` on those only (the LM head is the largest matmul for small models).
Weights arrive under Hugging Face names through `load_weights` (model/llama_weights.py), which packs
q/k/v and gate/up into the fused projections; every loader (safetensors, GGUF, dummy) feeds it the same way.
Where rope is one kernel and the attention backend writes with `store_kv` (LlamaAttention's
`stores_kv_in_rope`, the one place that decides), the rope kernel also stores the step's K/V, same bytes.
In the residual-stream form, o_proj and down_proj may hand the next norm split-K partial sums instead of
their output (`Linear.partial_sums` decides; kernels/splitk_linear.py): the norm's launch adds them up.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from conveyor.kernels.rotary import rotary_
from conveyor.kernels.splitk_linear import PartialSums
from conveyor.model.attention import Attention, AttentionBackend
from conveyor.model.attention_metadata import AttentionMetadata
from conveyor.model.layers import (
    GatedMLP,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary_qk,
    linear,
    rotary_fusable,
    split_k_partials,
    use_fused_kernels,
)
from conveyor.model.llama_cpu_stack import LlamaCPUStack
from conveyor.model.llama_weights import LlamaCheckpoint
from conveyor.model.parallel_layers import VocabParallelEmbedding
from conveyor.model.quantized import QuantizedEmbedding, QuantizedLinear
from conveyor.model.registry import ModelArchConfig

class LlamaAttention(nn.Module):
    """Fused qkv projection, rope, paged attention, output projection."""

    fused_launches = True
    """Rope also stores K/V where `stores_kv_in_rope` says so (`set_fused_launches` turns it off)."""

    def __init__(self, config: ModelArchConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        total = self.q_size + 2 * self.kv_size
        self.qkv_proj = Linear(config.hidden_size, total, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, backend)

    def shard_sizes(self) -> list[int]:
        """Row counts of q, k, v inside qkv_proj."""
        return [self.q_size, self.kv_size, self.kv_size]

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook before rope (Qwen3 adds per-head RMSNorm); q [T, H, d], k [T, kvh, d]."""
        return q, k

    def position_qk(self, q: torch.Tensor, k: torch.Tensor,
                    rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """`normalize_qk`, then rope; q [T, H, d], k [T, kvh, d], rope = (cos, sin) [T, d] (Qwen3 fuses the two)."""
        q, k = self.normalize_qk(q, k)
        cos, sin = rope
        return apply_rotary_qk(q, k, cos, sin)

    def _fusable(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor) -> bool:
        """Whether `position_qk` is one kernel (a subclass changing it overrides this and `rope_and_store_kv_`)."""
        return rotary_fusable(q, k, cos)

    def stores_kv_in_rope(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                          kv_cache: torch.Tensor) -> bool:
        """The one decision: rope stores this step's K/V (`rope_and_store_kv_`), not `write_kv`, where the fused
        launches are on, rope is one kernel (`_fusable`) and the attention takes it (`accepts_kv_from_rope`)."""
        return self.fused_launches and self._fusable(q, k, cos) and self.attn.accepts_kv_from_rope(k, v, kv_cache)

    def rope_and_store_kv_(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """`position_qk` in place plus k, v [T, kvh, d] into kv_cache at slot_mapping [T]: one kernel (rotary.py)."""
        rotary_(q, k, *rope, value=v, key_cache=kv_cache[0], value_cache=kv_cache[1], slot_mapping=slot_mapping,
                kv_scales=self.attn.kv_scales)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
        metadata: AttentionMetadata, partial_sums: bool = False,
    ) -> torch.Tensor | PartialSums:
        """x [T, hidden], rope = (cos, sin) [T, d] -> [T, hidden]; q [T, H, d], k and v [T, kvh, d] are views.
        With `partial_sums` (the caller's next norm takes them) o_proj's split-K partials where it allows them."""
        num_tokens = x.shape[0]
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in self.qkv_proj(x).split(self.shard_sizes(), dim=-1))
        if kv_stored := self.stores_kv_in_rope(q, k, v, rope[0], kv_cache):
            self.rope_and_store_kv_(q, k, v, rope, kv_cache, metadata.slot_mapping)
        else:
            q, k = self.position_qk(q, k, rope)
        out = self.attn(q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v.reshape(num_tokens, -1), kv_cache,
                        metadata, kv_stored=kv_stored)
        if partial_sums and (sums := split_k_partials(self.o_proj, out)) is not None:
            return sums
        return self.o_proj(out)


@dataclass
class ResidualStream:
    """The residual stream between decoder layers, `residual + delta`, held in one place that the layers
    update: a (delta, residual) tuple passed and returned would stay alive in the caller's names through
    the whole next layer, two [T, hidden] tensors more at its MLP (mutable on purpose: only lifetimes)."""

    delta: torch.Tensor | PartialSums | None
    """What the next norm adds: the previous layer's MLP output (maybe as down_proj's split-K partials), or the
    embeddings before the first layer."""
    residual: torch.Tensor | None = None
    """The stream before `delta` (None before the first layer)."""


class LlamaDecoderLayer(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(x))."""

    attention_cls: type[LlamaAttention] = LlamaAttention
    cpu_stack_compatible = True
    """The layer computes what kernels/cpu/decoder_stack.c's layer does (a subclass that adds to it,
    e.g. a q/k norm, says False): decode steps of a GGUF model on the CPU may then run there."""

    def __init__(self, config: ModelArchConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self.attention_cls(config, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, metadata)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_residual(self, stream: ResidualStream, rope: tuple[torch.Tensor, torch.Tensor],
                         kv_cache: torch.Tensor, metadata: AttentionMetadata) -> None:
        """`forward` in the residual-stream form of the fused path: the stream is `residual + delta` and each
        add rides in the following norm's launch. Updates `stream` to (this layer's MLP output, the stream
        before it), which sum to what `forward` returns. Each [T, hidden] input is dropped once its add is
        done, and the attention output before the MLP runs: the MLP's gate_up and activation set the
        forward's peak, and nothing else but its input and the stream's residual is alive beside them."""
        delta, stream.delta = stream.delta, None
        assert delta is not None, "the stream holds the previous layer's output"
        if stream.residual is None:  # the first layer: the stream is the embeddings, nothing to add yet
            assert isinstance(delta, torch.Tensor), "the embeddings"
            hidden, stream.residual = self.input_layernorm(delta), delta
        else:
            hidden, stream.residual = self.input_layernorm.add_and_norm(delta, stream.residual)
        del delta
        attn_out = self.self_attn(hidden, rope, kv_cache, metadata, partial_sums=True)
        hidden, stream.residual = self.post_attention_layernorm.add_and_norm(attn_out, stream.residual)
        del attn_out
        stream.delta = self.mlp(hidden, partial_sums=True)


class LlamaModel(nn.Module):
    """Embedding, decoder stack and final norm (HF's `model.*` namespace)."""

    def __init__(self, config: ModelArchConfig, backend: AttentionBackend, layer_cls: type[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([layer_cls(config, backend) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)


class LlamaForCausalLM(LlamaCheckpoint):
    """Decoder-only LM over a paged KV cache; see the module docstring for the calling convention."""

    layer_cls: type[nn.Module] = LlamaDecoderLayer
    fused_launches = True
    """Where `use_fused_kernels` holds, run the residual-stream stack (`set_fused_launches`)."""

    def __init__(self, config: ModelArchConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, backend, self.layer_cls)
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def num_heads(self) -> int:
        """Query heads computed by this process: all of them, or a tensor-parallel rank's share."""
        return self.model.layers[0].self_attn.num_heads

    @property
    def num_kv_heads(self) -> int:
        """KV heads held (and cached) by this process: all of them, or a tensor-parallel rank's share."""
        return self.model.layers[0].self_attn.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype (the norms' weights are never quantized)."""
        return self.model.norm.weight.dtype

    def set_attention_backend(self, backend: AttentionBackend) -> None:
        """Route every layer's attention through `backend` (e.g. after moving to CUDA)."""
        for module in self.modules():
            if isinstance(module, Attention):
                module.backend = backend

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> hidden [T, hidden]; writes the tokens' K/V into kv_caches."""
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.model.layers)} layers")
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        rope = self.model.rotary_emb(positions, x.dtype)
        if self.cpu_stack is not None and self.cpu_stack.takes(x):  # decode steps: one C call, same bits
            return self.model.norm(self.cpu_stack.run(x, rope, kv_caches, metadata))
        if self.uses_residual_stream(x):
            stream = ResidualStream(x)
            del x  # the stream owns the embeddings: they go once the first layer has added its attention
            return self._forward_residual_stream(stream, rope, kv_caches, metadata)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x = layer(x, rope, kv_cache, metadata)
        return self.model.norm(x)

    def _forward_residual_stream(self, stream: ResidualStream, rope: tuple[torch.Tensor, torch.Tensor],
                                 kv_caches: list[torch.Tensor], metadata: AttentionMetadata) -> torch.Tensor:
        """The decoder stack with each residual add fused into the next norm (`forward_residual`); the
        final norm takes the last add. The stream starts as the [T, hidden] embeddings -> [T, hidden], the
        same bits as the loop."""
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            layer.forward_residual(stream, rope, kv_cache, metadata)
        assert stream.delta is not None and stream.residual is not None, "a model without layers"
        return self.model.norm.add_and_norm(stream.delta, stream.residual)[0]

    def uses_residual_stream(self, x: torch.Tensor) -> bool:
        """Whether `forward` runs the residual-stream stack for embeddings x: on the fused kernels' devices
        and dtypes, unless `set_fused_launches(False)`; the CPU paths keep the plain loop."""
        return self.fused_launches and use_fused_kernels(x)

    def set_fused_launches(self, enabled: bool) -> None:
        """Turn the fusions across layer boundaries (residual add + norm, Qwen3's q/k norm + rope, rope + K/V
        store, split-K o/down projections summed in the next norm) on or off, e.g. to compare with the separate kernels; the per-op fused kernels are not affected."""
        for module in self.modules():
            if hasattr(module, "fused_launches"):
                module.fused_launches = enabled

    @functools.cached_property
    def cpu_stack(self) -> LlamaCPUStack | None:
        """The layers as one C call per few-token step on the CPU, where they allow it (decided on first use)."""
        return LlamaCPUStack.for_layers(self.model.layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] (float32 for stable sampling)."""
        return self.lm_head_logits(hidden).float()

    def lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] as the LM head computes them: the model's dtype for a
        plain head (bf16 on a GPU), float32 for quantized and tensor-parallel heads. The runner hands
        these to the sampler, which converts to float32 only where it edits or stages them."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        if isinstance(head, (QuantizedEmbedding, VocabParallelEmbedding)):
            return head.project(hidden)
        if isinstance(head, QuantizedLinear):
            return head(hidden)
        return linear(hidden, head.weight)  # CPU: (W @ h^T)^T, ~2x faster for a few rows
