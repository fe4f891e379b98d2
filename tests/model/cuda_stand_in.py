"""A CPU tensor that says it is on CUDA, for the model's kernel decisions tested without a GPU."""

from __future__ import annotations

from typing import Any

import torch


class OnCuda:
    """A CPU tensor that says it is on CUDA: what a decision reads (device, dtype, shape, strides), no kernel runs."""

    is_cuda = True

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tensor, name)
