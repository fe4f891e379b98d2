"""Tensor-parallel layers: one rank's shard of a projection or of the vocabulary, and the collective after it.

The model (Megatron-LM's split, as vLLM and gpt-fast use it): a pair of projections around a
nonlinearity is split so that only one collective is needed per pair. The first projection of a pair
is *column-parallel* (`ColumnParallelLinear`: each rank holds some output rows -- its attention heads
of q/k/v, its columns of gate/up -- and computes them from the full input, no communication); the
second is *row-parallel* (`RowParallelLinear`: each rank holds the matching input columns of o_proj /
down_proj, multiplies its partial activations and the partial sums are added by one all-reduce). The
vocabulary is split in contiguous ranges of `ceil(V / N)` rows: the embedding looks up only the ids
in its range, zeroes the others and all-reduces (each id is found on exactly one rank); the LM head
computes its range's logits and all-gathers them, so every rank holds the full `[N, V]` logits and
samples the same tokens from them with the same generator (no broadcast of sampled ids).

Splits may be uneven (`split_evenly`): the first ranks take one more row, head or column. Every rank
receives the same collectives in the same order with the same shapes (all-reduce outputs are full
width; the gather pads the last vocabulary range), which also makes them capturable in CUDA graphs.
Weights arrive as the full Hugging Face tensors and each layer copies out its own rows or columns
(`load_full`), so safetensors, GGUF (dequantized) and dummy weights are sharded by the same code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from conveyor.model.layers import Linear, linear


@dataclass(frozen=True)
class Span:
    """A half-open index range [start, stop) of a full tensor dimension."""

    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def split_evenly(total: int, world_size: int, rank: int) -> Span:
    """Rank `rank`'s contiguous part of `total` items: sizes differ by at most one, larger ones first."""
    base, extra = divmod(total, world_size)
    start = rank * base + min(rank, extra)
    return Span(start, start + base + (1 if rank < extra else 0))


@dataclass(frozen=True)
class TensorParallelGroup:
    """One rank's place in the tensor-parallel group; its collectives run on the default process group."""

    rank: int
    """This process's rank, 0 .. world_size - 1."""
    world_size: int
    """Ranks the model is split over."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, in place (the same bits on every rank)."""
        dist.all_reduce(x)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] on every rank -> [N, world_size * D], ranks' parts side by side in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.world_size)]  # W x [N, D]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


class ColumnParallelLinear(Linear):
    """y = x W_r^T for this rank's output rows W_r: one span of each fused part's full weight.

    `spans[i]` are the rows this rank keeps of fused part i (q, k, v or gate, up); they are stacked in
    that order, so the local output splits by part exactly as the unsharded one does.
    """

    tensor_parallel = True

    def __init__(self, in_features: int, spans: tuple[Span, ...], bias: bool) -> None:
        super().__init__(in_features, sum(span.size for span in spans), bias=bias)
        self.spans = spans

    def load_full(self, attr: str, part: int | None, full: torch.Tensor) -> None:
        """Copy this rank's rows of one full HF tensor (part `part` of the fused weight, or the whole)."""
        index = 0 if part is None else part
        span = self.spans[index]
        offset = sum(s.size for s in self.spans[:index])
        target = getattr(self, attr).data.narrow(0, offset, span.size)
        _copy_checked(target, full.narrow(0, span.start, span.size), f"{attr} part {part}")


class RowParallelLinear(Linear):
    """y = sum over ranks of x_r W_r^T (+ bias once): this rank's input columns, then an all-reduce."""

    tensor_parallel = True

    def __init__(self, columns: Span, out_features: int, bias: bool, group: TensorParallelGroup) -> None:
        super().__init__(columns.size, out_features, bias=bias)
        self.columns = columns
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in_r] (this rank's slice of the input features) -> [T, out], identical on every rank."""
        out = self.group.all_reduce(linear(x, self.weight, None, self.weight_scale, self.input_scale,
                                           self.use_triton_gemm))
        return out if self.bias is None else out + self.bias

    def load_full(self, attr: str, part: int | None, full: torch.Tensor) -> None:
        """The weight's columns of this rank; the bias whole (it is added after the reduction)."""
        source = full.narrow(1, self.columns.start, self.columns.size) if attr == "weight" else full
        _copy_checked(getattr(self, attr).data, source, attr)


class VocabParallelEmbedding(nn.Module):
    """This rank's range of the [vocab, hidden] table: embedding lookups and, as the LM head, logits.

    Rows [rows.start, rows.stop) are real; the table has `padded_rows` rows (ceil(V / N)) so that every
    rank's logits have the same width for the gather. Padding rows are zero and their logits are cut.
    """

    def __init__(self, vocab_size: int, embedding_dim: int, group: TensorParallelGroup) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.padded_rows = -(-vocab_size // group.world_size)
        start = min(group.rank * self.padded_rows, vocab_size)
        self.rows = Span(start, min(start + self.padded_rows, vocab_size))
        self.group = group
        self.weight = nn.Parameter(torch.empty(self.padded_rows, embedding_dim))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, hidden]: each id's row from the one rank that holds it (all-reduce)."""
        local = input_ids - self.rows.start
        mine = (local >= 0) & (local < self.rows.size)  # [T]
        out = F.embedding(local.masked_fill(~mine, 0), self.weight)  # [T, hidden]
        out.mul_(mine.unsqueeze(-1).to(out.dtype))
        return self.group.all_reduce(out)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32, gathered: the same on every rank."""
        local = linear(hidden, self.weight).float()  # [N, padded_rows]
        return self.group.all_gather_last_dim(local)[:, : self.vocab_size]

    def load_full(self, attr: str, part: int | None, full: torch.Tensor) -> None:
        """This rank's rows of the full [vocab, hidden] table; padding rows zeroed."""
        with torch.no_grad():
            self.weight.data[self.rows.size :].zero_()
        source = full.narrow(0, self.rows.start, self.rows.size)
        _copy_checked(self.weight.data[: self.rows.size], source, attr)


ShardedModule = ColumnParallelLinear | RowParallelLinear | VocabParallelEmbedding
"""The modules that take full checkpoint tensors and keep their own shard (`load_full`)."""


def _copy_checked(target: torch.Tensor, source: torch.Tensor, what: str) -> None:
    if tuple(target.shape) != tuple(source.shape):
        raise ValueError(f"{what}: this rank's shard is {tuple(target.shape)}, the checkpoint gives "
                         f"{tuple(source.shape)}")
    with torch.no_grad():
        target.copy_(source)
