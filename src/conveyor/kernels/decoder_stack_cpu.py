"""A Llama-family decoder stack over a few tokens in one C call (kernels/cpu/decoder_stack.c).

The model: the C function runs every layer's kernels (RMSNorm, GGUF block matmuls, rope, the K/V
store, paged attention, SiLU-and-mul, residual adds) in the order the per-layer Python path calls
them, on the same buffers, so its result is that path's bit for bit; what it removes is Python,
torch dispatch and ctypes around ~12 calls per layer. Here: the tensors it reads, described as ctypes
structures once (`StackLayers`, kept alive with the tensors they point into), and `run_decoder_stack`,
which checks one step's tensors and calls it. The reference is the per-layer model itself
(tests/model/test_llama_cpu_stack.py compares the two).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from conveyor.kernels.cpu_build import cpu_kernels

_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class _BlockWeight(ctypes.Structure):
    _fields_ = [("qs", _P), ("d", _P), ("m", _P), ("n", _I64), ("k", _I64)]


class _DecoderLayer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", _BlockWeight), ("o", _BlockWeight),
                ("gate_up", _BlockWeight), ("down", _BlockWeight), ("kv_cache", _P)]


class _StackShape(ctypes.Structure):
    _fields_ = [("hidden", _I64), ("num_heads", _I64), ("num_kv_heads", _I64), ("head_dim", _I64),
                ("intermediate", _I64), ("block_size", _I64), ("num_blocks", _I64), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float)]


class _Queries(ctypes.Structure):
    _fields_ = [("token_starts", _P), ("num_tokens", _P), ("seq_rows", _P), ("count", _I64)]


class _StepInputs(ctypes.Structure):
    _fields_ = [("num_tokens", _I64), ("x", _P), ("cos", _P), ("sin", _P), ("slots", _P),
                ("short_queries", _Queries), ("prefill_queries", _Queries), ("block_tables", _P),
                ("max_blocks", _I64), ("seq_lens", _P), ("h", _P), ("qkv", _P), ("q", _P), ("attn", _P),
                ("gate_up", _P), ("act", _P)]


@dataclass(frozen=True)
class BlockWeightTensors:
    """A projection [N, K] in GGUF blocks, as kernels/gguf_matmul.py lays it out."""

    qweight: torch.Tensor
    """Q4: [N, K/2] uint8; Q8_0: [N, K] int8."""
    scales: torch.Tensor
    """[N, K/32] float32."""
    mins: torch.Tensor | None
    """[N, K/32] float32 for Q4, None for Q8_0."""


@dataclass(frozen=True)
class LayerTensors:
    """One decoder layer's weights and KV cache."""

    input_norm: torch.Tensor
    """[H] float32."""
    post_norm: torch.Tensor
    """[H] float32."""
    qkv: BlockWeightTensors
    """[Q + 2 KV, H]: q, k, v rows stacked."""
    o: BlockWeightTensors
    gate_up: BlockWeightTensors
    """[2 I, H]: gate, then up rows."""
    down: BlockWeightTensors
    kv_cache: torch.Tensor
    """[2, num_blocks, block_size, num_kv_heads, head_dim] float32."""


@dataclass(frozen=True)
class StackShape:
    """The model's shape and the attention's constants."""

    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    """RMSNorm epsilon."""
    scale: float
    """Attention scale (head_dim ** -0.5)."""


@dataclass(frozen=True)
class PagedQueries:
    """One kind of attention query of a step (attention_cpu's plan): [C] int64 each."""

    token_starts: torch.Tensor
    num_tokens: torch.Tensor
    seq_rows: torch.Tensor


@dataclass(frozen=True)
class StepTensors:
    """What one step hands the stack."""

    x: torch.Tensor
    """[T, H] float32, contiguous: the embeddings in, the last layer's residual stream out."""
    cos: torch.Tensor
    """[T, head_dim] float32, contiguous (sin likewise)."""
    sin: torch.Tensor
    slot_mapping: torch.Tensor
    """[T] int64: each token's flat cache slot."""
    short: PagedQueries
    """Queries of up to 8 tokens (the decode kernel)."""
    prefill: PagedQueries
    """Longer queries (the prefill kernel)."""
    block_tables: torch.Tensor
    """[num_seqs, max_blocks] int32, contiguous."""
    seq_lens: torch.Tensor
    """[num_seqs] int32."""


def _weight_struct(w: BlockWeightTensors, n: int, k: int) -> _BlockWeight:
    codes_k = k // 2 if w.mins is not None else k
    assert tuple(w.qweight.shape) == (n, codes_k) and tuple(w.scales.shape) == (n, k // 32), "weight shape"
    assert w.scales.dtype == torch.float32 and all(t.is_contiguous() for t in (w.qweight, w.scales))
    assert w.mins is None or (w.mins.dtype == torch.float32 and w.mins.is_contiguous() and w.mins.shape == w.scales.shape)
    mins = None if w.mins is None else w.mins.data_ptr()
    return _BlockWeight(w.qweight.data_ptr(), w.scales.data_ptr(), mins, n, k)


class StackLayers:
    """The C view of a model's layers (weights and KV caches) and the scratch of up to `max_tokens`
    tokens; holds the tensors it points into, so they live as long as it does."""

    def __init__(self, layers: Sequence[LayerTensors], shape: StackShape, max_tokens: int) -> None:
        q, kv, h, i = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim, shape.hidden, shape.intermediate
        cache_shape = layers[0].kv_cache.shape
        assert cache_shape[0] == 2 and tuple(cache_shape[3:]) == (shape.num_kv_heads, shape.head_dim), "cache shape"
        structs = []
        for layer in layers:
            assert layer.kv_cache.shape == cache_shape and layer.kv_cache.dtype == torch.float32
            assert layer.kv_cache.is_contiguous() and layer.input_norm.is_contiguous() and layer.post_norm.is_contiguous()
            structs.append(_DecoderLayer(
                layer.input_norm.data_ptr(), layer.post_norm.data_ptr(), _weight_struct(layer.qkv, q + 2 * kv, h),
                _weight_struct(layer.o, h, q), _weight_struct(layer.gate_up, 2 * i, h), _weight_struct(layer.down, h, i),
                layer.kv_cache.data_ptr()))
        self.layers = list(layers)
        self.array = (_DecoderLayer * len(structs))(*structs)
        self.shape = _StackShape(h, shape.num_heads, shape.num_kv_heads, shape.head_dim, i, cache_shape[2],
                                 cache_shape[1], shape.eps, shape.scale)
        self.max_tokens = max_tokens
        self.scratch = [torch.empty(max_tokens, width) for width in (h, q + 2 * kv, q, q, 2 * i, i)]
        """h, qkv, q, attn, gate_up, act (StepInputs' order)."""


def _queries(queries: PagedQueries) -> _Queries:
    tensors = (queries.token_starts, queries.num_tokens, queries.seq_rows)
    assert all(t.dtype == torch.int64 and t.is_contiguous() and t.shape == tensors[0].shape for t in tensors)
    return _Queries(*(t.data_ptr() for t in tensors), tensors[0].numel())


def run_decoder_stack(stack: StackLayers, step: StepTensors) -> None:
    """Run every layer of `stack` over the step's tokens: step.x is updated in place."""
    num_tokens = step.x.shape[0]
    assert 0 < num_tokens <= stack.max_tokens, f"{num_tokens} tokens for a stack of at most {stack.max_tokens}"
    assert step.x.dtype == torch.float32 and step.x.is_contiguous() and step.x.shape[1] == stack.shape.hidden
    assert step.cos.shape == step.sin.shape == (num_tokens, stack.shape.head_dim) and step.cos.is_contiguous()
    assert step.sin.is_contiguous() and step.slot_mapping.dtype == torch.int64 and step.slot_mapping.is_contiguous()
    assert step.slot_mapping.shape == (num_tokens,)
    assert step.block_tables.dtype == step.seq_lens.dtype == torch.int32 and step.block_tables.is_contiguous()
    inputs = _StepInputs(num_tokens, step.x.data_ptr(), step.cos.data_ptr(), step.sin.data_ptr(),
                         step.slot_mapping.data_ptr(), _queries(step.short), _queries(step.prefill),
                         step.block_tables.data_ptr(), step.block_tables.shape[1], step.seq_lens.data_ptr(),
                         *(buffer.data_ptr() for buffer in stack.scratch))
    status = cpu_kernels().decoder_stack(ctypes.addressof(stack.array), len(stack.layers), ctypes.byref(stack.shape),
                                         ctypes.byref(inputs), torch.get_num_threads())
    if status == 2:
        raise MemoryError("the CPU decoder stack could not allocate a kernel's scratch")
    assert status == 0, "the CPU decoder stack rejected its attention geometry"
