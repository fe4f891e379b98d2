"""GGUF-quantized weights served as they are: block tensors, and the Linear / Embedding that compute on them.

The model: a GGUF stores a 2-D weight [N, K] as blocks of 32 consecutive weights along K, each with
its own float16 scale (and minimum, for Q4_1). `QuantizedWeight` keeps exactly those values, in the
layout the CPU kernels read (kernels/gguf_matmul.py): the 4-bit codes as they are, the scales and
minimums widened to float32 (exact). Q4_0 (w = d (q - 8)) becomes the Q4 layout with m = -8 d.
Rows are independent, so the loader may permute rows (llama.cpp's Q/K order) and stack the q/k/v or
gate/up shards into one fused weight without touching a block. `QuantizedLinear` multiplies few-row
inputs (decode) with the block kernel and dequantizes once per call for prefill-sized inputs, where
a float32 GEMM (oneDNN, kernels/cpu_gemm.py) is faster than unpacking per row; either way the result
is the float32 matmul of the dequantized weight up to the order of float32 additions. `QuantizedEmbedding` gathers and
dequantizes only the looked-up rows, and serves as the tied LM head.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from conveyor.kernels.cpu_gemm import prefill_linear
from conveyor.kernels.gguf_matmul import (
    BLOCK,
    q4_dequantize,
    q4_matmul,
    q8_0_dequantize,
    q8_0_matmul,
)

MAX_KERNEL_ROWS = 32
"""Inputs with at most this many rows use the block kernel; more rows dequantize the weight into a
reused buffer and use oneDNN's GEMM. The kernel is compute-bound (its cost grows with every row) while
dequantize + GEMM costs one pass over the weight plus a little per row. SmolLM2's 120 projections, one
thread, Zen 4, after the kernel kept its inputs in registers (kernel vs dequantize + oneDNN): 16 rows
54 vs 80 ms, 32 rows 83 vs 105, 48 rows 149 vs 162; the Q8_0 LM head (49,152 x 576): 16 rows 12.6 vs
25.8 ms, 32 rows 25.9 vs 36.9, 48 rows 41.7 vs 46.7. On session 8's Zen 5, before that change, 16 rows
were a tie and 32 rows favoured the GEMM by a third; 32 keeps a margin on this CPU and is about a tie
there (docs/performance.md, session 9). CPU decode steps up to this size also run as one C call
(llama_cpu_stack.py)."""


class BlockFormat(enum.Enum):
    """The kernel layouts (GGUF types map onto them in gguf_weights)."""

    Q4 = "q4"
    """4-bit codes q in 0..15, w = d q + m per block (GGUF Q4_1; Q4_0 with m = -8 d)."""
    Q8_0 = "q8_0"
    """int8 codes, w = d q per block (GGUF Q8_0)."""


@dataclass(frozen=True)
class QuantizedWeight:
    """One weight [N, K] in blocks of 32 along K (see the module docstring for the layout)."""

    block_format: BlockFormat
    """Which kernel layout the tensors hold."""
    qweight: torch.Tensor
    """Q4: [N, K/2] uint8 packed codes; Q8_0: [N, K] int8 codes."""
    scales: torch.Tensor
    """[N, K/32] float32 per-block scales d."""
    mins: torch.Tensor | None
    """[N, K/32] float32 per-block minimums m (Q4), None for Q8_0."""

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.scales.shape[1] * BLOCK

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedWeight:
        """The same weight with `fn` (a row permutation of a [N, ...] tensor) applied to every part."""
        mins = None if self.mins is None else fn(self.mins).contiguous()
        return QuantizedWeight(self.block_format, fn(self.qweight).contiguous(), fn(self.scales).contiguous(), mins)

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, K] float32 (into `out` when given)."""
        if self.block_format == BlockFormat.Q4:
            assert self.mins is not None
            return q4_dequantize(self.qweight, self.scales, self.mins, out)
        return q8_0_dequantize(self.qweight, self.scales, out)


class DequantScratch:
    """One float32 buffer every quantized layer of a model dequantizes into for prefill-sized inputs
    (layers run one after another, so one buffer of the largest weight serves them all)."""

    def __init__(self) -> None:
        self._buffer = torch.empty(0)

    def weight(self, num_rows: int, num_cols: int) -> torch.Tensor:
        """A [num_rows, num_cols] float32 view of the buffer (grown when too small)."""
        if self._buffer.numel() < num_rows * num_cols:
            self._buffer = torch.empty(num_rows * num_cols)
        return self._buffer[: num_rows * num_cols].view(num_rows, num_cols)


class QuantizedLinear(nn.Module):
    """A bias-optional linear layer whose weight lives in GGUF blocks (buffers filled by the loader)."""

    def __init__(self, in_features: int, out_features: int, block_format: BlockFormat, bias: bool) -> None:
        super().__init__()
        if in_features % BLOCK:
            raise ValueError(f"in_features {in_features} is not a multiple of the GGUF block size {BLOCK}")
        self.in_features, self.out_features, self.block_format = in_features, out_features, block_format
        codes = (out_features, in_features // 2) if block_format == BlockFormat.Q4 else (out_features, in_features)
        codes_dtype = torch.uint8 if block_format == BlockFormat.Q4 else torch.int8
        self.register_buffer("qweight", torch.empty(codes, dtype=codes_dtype))
        self.register_buffer("scales", torch.empty(out_features, in_features // BLOCK))
        mins = torch.empty(out_features, in_features // BLOCK) if block_format == BlockFormat.Q4 else None
        self.register_buffer("mins", mins)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.scratch = DequantScratch()
        """Where prefill-sized calls dequantize (quantize_modules gives all layers of a model one)."""

    def weight_parts(self) -> QuantizedWeight:
        """The buffers as a QuantizedWeight (views, no copy)."""
        return QuantizedWeight(self.block_format, self.qweight, self.scales, self.mins)

    def load_rows(self, start: int, weight: QuantizedWeight) -> None:
        """Copy `weight` into output rows [start, start + N) (one shard of a fused projection)."""
        if weight.block_format != self.block_format or weight.shape[1] != self.in_features:
            raise ValueError(f"shard {weight.block_format.value} {weight.shape} does not fit "
                             f"{self.block_format.value} [{self.out_features}, {self.in_features}]")
        rows = weight.shape[0]
        with torch.no_grad():
            for target, source in zip((self.qweight, self.scales, self.mins),
                                      (weight.qweight, weight.scales, weight.mins)):
                if target is not None:
                    target.narrow(0, start, rows).copy_(source)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] float32 -> [T, out] float32."""
        if x.shape[0] > MAX_KERNEL_ROWS:
            weight = self.weight_parts().dequantize(self.scratch.weight(self.out_features, self.in_features))
            return prefill_linear(x, weight, self.bias)
        x = x.contiguous()
        if self.block_format == BlockFormat.Q4:
            out = q4_matmul(x, self.qweight, self.scales, self.mins)
        else:
            out = q8_0_matmul(x, self.qweight, self.scales)
        return out if self.bias is None else out + self.bias


class QuantizedEmbedding(QuantizedLinear):
    """Token embedding over a block-quantized [vocab, hidden] table; `project` is the tied LM head."""

    def __init__(self, num_embeddings: int, embedding_dim: int, block_format: BlockFormat) -> None:
        super().__init__(embedding_dim, num_embeddings, block_format, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, hidden] float32, dequantizing only the looked-up rows."""
        rows = QuantizedWeight(
            self.block_format, self.qweight.index_select(0, input_ids), self.scales.index_select(0, input_ids),
            None if self.mins is None else self.mins.index_select(0, input_ids),
        )
        return rows.dequantize()

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32 (the LM head tied to this table)."""
        return QuantizedLinear.forward(self, hidden)


def quantize_modules(model: nn.Module, formats: dict[str, BlockFormat]) -> None:
    """Replace each nn.Linear / nn.Embedding named in `formats` by its block-quantized twin, in place.

    Called on the meta-device model before it is materialized, so the float32 weights of the replaced
    modules are never allocated. The new modules share one DequantScratch.
    """
    scratch = DequantScratch()
    for name, block_format in formats.items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        twin = _quantized_twin(name, getattr(parent, attr), block_format)
        twin.scratch = scratch
        setattr(parent, attr, twin)


def _quantized_twin(name: str, old: nn.Module, block_format: BlockFormat) -> nn.Module:
    if not isinstance(old, (nn.Linear, nn.Embedding)):
        raise ValueError(f"{name} is a {type(old).__name__}; only Linear and Embedding can be quantized")
    with torch.device(old.weight.device):  # the meta device: nothing is allocated yet
        if isinstance(old, nn.Embedding):
            return QuantizedEmbedding(old.num_embeddings, old.embedding_dim, block_format)
        return QuantizedLinear(old.in_features, old.out_features, block_format, bias=old.bias is not None)
