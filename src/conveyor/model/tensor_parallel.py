"""Sharding a Llama-family model for tensor parallelism: which heads, columns and vocabulary rows a rank keeps.

The model (gpt-fast's tp.py, applied before the weights exist): the loader builds the ordinary model
on the meta device, `shard_model` swaps its projections, embedding and LM head for the parallel layers
of parallel_layers.py and shrinks each attention to the rank's heads, and only then is the module
materialized -- so a rank never allocates more than its shard. Attention is split by KV-head group
(`head_shard`): with at least as many KV heads as ranks, each rank takes a contiguous run of KV heads
and exactly the query heads that read them (uneven when the counts do not divide: SmolLM2's 3 KV
heads over 2 ranks are 2 + 1, with 6 + 3 query heads); with fewer KV heads than ranks, each KV head is
replicated on `N / num_kv_heads` ranks, which divide its query heads among them (vLLM's rule). The
MLP's intermediate columns are split as evenly as they go. A rank's KV cache holds only its own KV
heads. Dummy weights are drawn as the unsharded model would draw them (`iter_full_dummy_weights`) and
then sharded like a checkpoint, so the same --seed gives the same model at every tensor-parallel size.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from conveyor.config import Quantization
from conveyor.model.attention import Attention
from conveyor.model.layers import GatedMLP, RMSNorm
from conveyor.model.llama import LlamaAttention, LlamaForCausalLM
from conveyor.model.parallel_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    Span,
    TensorParallelGroup,
    VocabParallelEmbedding,
    split_evenly,
)
from conveyor.model.registry import ModelArchConfig

FLAG = "--tensor-parallel-size"


class TensorParallelError(ValueError):
    """The model cannot be split that way; the message names the flag and what would work."""


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank holds (global head indices)."""

    q_heads: Span
    """Query heads."""
    kv_heads: Span
    """Key/value heads (one replicated head when the model has fewer KV heads than ranks)."""


def head_shard(num_heads: int, num_kv_heads: int, world_size: int, rank: int) -> HeadShard:
    """Rank `rank`'s heads (see the module docstring); raises TensorParallelError for impossible splits."""
    group_size = num_heads // num_kv_heads  # query heads per KV head
    if world_size > num_heads:
        raise TensorParallelError(f"{FLAG} {world_size} is more than the model's {num_heads} attention heads; "
                                  f"use at most {num_heads}")
    if num_kv_heads >= world_size:
        kv = split_evenly(num_kv_heads, world_size, rank)
        return HeadShard(Span(kv.start * group_size, kv.stop * group_size), kv)
    if world_size % num_kv_heads:
        multiples = ", ".join(str(num_kv_heads * k) for k in range(1, 4))
        raise TensorParallelError(
            f"{FLAG} {world_size}: the model has {num_kv_heads} KV heads, fewer than the ranks, so the ranks must "
            f"be a multiple of them ({multiples}, ...) or at most {num_kv_heads}")
    replicas = world_size // num_kv_heads
    kv_head = rank // replicas
    within = split_evenly(group_size, replicas, rank % replicas)
    start = kv_head * group_size
    return HeadShard(Span(start + within.start, start + within.stop), Span(kv_head, kv_head + 1))


def check_tensor_parallel(config: ModelArchConfig, world_size: int) -> None:
    """Raise TensorParallelError unless every rank gets a head, a KV head and MLP columns."""
    for rank in range(world_size):
        head_shard(config.num_attention_heads, config.num_key_value_heads, world_size, rank)
    if world_size > config.intermediate_size:
        raise TensorParallelError(f"{FLAG} {world_size} exceeds the MLP width {config.intermediate_size}")


def tensor_parallel_quantization(requested: Quantization) -> Quantization:
    """Under tensor parallelism GGUF weights are dequantized (the block kernels are single-process); FP8
    quantizes each rank's shard after loading (model/fp8_weights.py)."""
    if requested == Quantization.GGUF:
        raise TensorParallelError(f"--quantization gguf does not run with {FLAG} > 1 (the block-quantized CPU "
                                  "path is single-process); use --quantization none")
    return requested if requested.is_fp8 else Quantization.NONE


def shard_model(model: LlamaForCausalLM, group: TensorParallelGroup) -> None:
    """Replace `model`'s projections, embedding and LM head by this rank's shards, in place, on the
    meta device (call inside `torch.device("meta")`, before materialization)."""
    config = model.config
    heads = head_shard(config.num_attention_heads, config.num_key_value_heads, group.world_size, group.rank)
    columns = split_evenly(config.intermediate_size, group.world_size, group.rank)
    for layer in model.model.layers:
        _shard_attention(layer.self_attn, config, heads, group)
        _shard_mlp(layer.mlp, config.hidden_size, columns, group)
    model.model.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, group)
    if model.lm_head is not None:
        model.lm_head = VocabParallelEmbedding(config.vocab_size, config.hidden_size, group)


def _shard_attention(attn: LlamaAttention, config: ModelArchConfig, heads: HeadShard,
                     group: TensorParallelGroup) -> None:
    d = config.head_dim
    q_rows = Span(heads.q_heads.start * d, heads.q_heads.stop * d)
    kv_rows = Span(heads.kv_heads.start * d, heads.kv_heads.stop * d)
    attn.num_heads, attn.num_kv_heads = heads.q_heads.size, heads.kv_heads.size
    attn.q_size, attn.kv_size = q_rows.size, kv_rows.size
    attn.qkv_proj = ColumnParallelLinear(config.hidden_size, (q_rows, kv_rows, kv_rows), bias=config.attention_bias)
    attn.o_proj = RowParallelLinear(q_rows, config.hidden_size, bias=attn.o_proj.bias is not None, group=group)
    attn.attn = Attention(attn.num_heads, attn.num_kv_heads, d, attn.attn.backend)


def _shard_mlp(mlp: GatedMLP, hidden_size: int, columns: Span, group: TensorParallelGroup) -> None:
    mlp.intermediate_size = columns.size
    mlp.gate_up_proj = ColumnParallelLinear(hidden_size, (columns, columns), bias=False)
    mlp.down_proj = RowParallelLinear(columns, hidden_size, bias=False, group=group)


def iter_full_dummy_weights(reference: LlamaForCausalLM, device: str, seed: int,
                            std: float) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named full tensors equal to what `loader.init_dummy_weights(seed)` gives the unsharded model:
    the same draws from one generator on `device`, in `reference`'s (a meta-device unsharded model)
    parameter order, with fused q/k/v and gate/up cut back into their HF parts."""
    generator = torch.Generator(device=device).manual_seed(seed)
    norm_weights = {id(m.weight) for m in reference.modules() if isinstance(m, RMSNorm)}
    for name, param in reference.named_parameters():
        if id(param) in norm_weights:
            value = torch.ones(param.shape, dtype=param.dtype, device=device)
        elif param.dim() == 1:
            value = torch.zeros(param.shape, dtype=param.dtype, device=device)
        else:
            value = torch.empty(param.shape, dtype=param.dtype, device=device).normal_(0.0, std, generator=generator)
        yield from _hf_parts(reference.config, name, value)


def _hf_parts(config: ModelArchConfig, name: str, value: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """A fused parameter as its HF tensors (q/k/v, gate/up); any other parameter as it is."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    fused = {".qkv_proj.": ((".q_proj.", q), (".k_proj.", kv), (".v_proj.", kv)),
             ".gate_up_proj.": ((".gate_proj.", config.intermediate_size), (".up_proj.", config.intermediate_size))}
    for marker, parts in fused.items():
        if marker in name:
            start = 0
            for hf_marker, rows in parts:
                yield name.replace(marker, hf_marker), value.narrow(0, start, rows)
                start += rows
            return
    yield name, value
