"""--quantization fp8: the loaded 16-bit model's decoder projections turned into FP8 weights, in place.

Every `layers.Linear` (q/k/v/o and gate/up/down, their tensor-parallel shards included: each rank
quantizes its own shard with its own scale, which the row-parallel all-reduce sums correctly) gets its
weight replaced by `fp8(W / s_w)` and `weight_scale` = s_w; its forward then takes `fp8_linear`
(kernels/fp8_linear.py). The embedding, the norms and the LM head (plain nn.Linear / nn.Embedding, or
the vocabulary-parallel shards) keep the model's dtype, as in vLLM.

--quantization ptpc_fp8 (`per_channel`): each output channel gets its own scale, held as the [1, N] row
that the forward's per-token path takes (`layers.linear` dispatches on the scale's shape).
"""

from __future__ import annotations

import torch
from torch import nn

from conveyor.kernels.fp8_linear import (
    quantize_weight_fp8,
    quantize_weight_fp8_per_channel,
)
from conveyor.model.layers import Linear


@torch.no_grad()
def quantize_linears_fp8(model: nn.Module, per_channel: bool = False) -> int:
    """Quantize every decoder projection of `model` (already loaded); returns how many."""
    quantize = quantize_weight_fp8_per_channel if per_channel else quantize_weight_fp8
    count = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.weight_scale is None:
            weight, scale = quantize(module.weight.data)  # [N, K] fp8, [] or [1, N] float32
            module.weight = nn.Parameter(weight, requires_grad=False)
            module.weight_scale = scale
            count += 1
    return count
