"""The C decoder stack (model/llama_cpu_stack.py) computes the per-layer modules' result bit for bit."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from conveyor.config import ModelConfig, Quantization
from conveyor.kernels.cpu_build import cpu_kernels_available
from conveyor.model.attention import TorchAttentionBackend
from conveyor.model.attention_metadata import SequenceSpec, build_attention_metadata
from conveyor.model.llama_cpu_stack import LlamaCPUStack
from conveyor.model.loader import load_model
from conveyor.model.quantized import MAX_KERNEL_ROWS
from paged import allocate_kv_caches

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="needs the C CPU kernels")
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return load_model(ModelConfig(quantization=Quantization.GGUF), "cpu", torch.float32, "cpu").module


@contextmanager
def modules_only(model: torch.nn.Module) -> Iterator[None]:
    stack = model.cpu_stack
    model.__dict__["cpu_stack"] = None  # the cached property's value: the per-layer path
    try:
        yield
    finally:
        model.__dict__["cpu_stack"] = stack


def blocks_of(seq: int, num_seqs: int = 3, count: int = 8) -> list[int]:
    """Interleaved block ids: the block tables matter."""
    return [1 + seq + j * num_seqs for j in range(count)]


def step(model: torch.nn.Module, kv_caches: list[torch.Tensor], queries: list[tuple[int, int]]) -> torch.Tensor:
    """One forward: per sequence (its context length before the step, its number of query tokens)."""
    specs = [SequenceSpec(n, start + n, blocks_of(i)) for i, (start, n) in enumerate(queries)]
    ids = [(37 * i + 11 * p) % 40_000 + 5 for i, (start, n) in enumerate(queries) for p in range(start, start + n)]
    positions = [p for start, n in queries for p in range(start, start + n)]
    metadata = build_attention_metadata(specs, BLOCK_SIZE, "cpu")
    with torch.no_grad():
        return model(torch.tensor(ids), torch.tensor(positions), kv_caches, metadata)


def both_paths(model: torch.nn.Module, steps: list[list[tuple[int, int]]]) -> None:
    """Run the same steps on two caches, the stack's and the modules'; every step's hidden states and
    the caches after it must be identical."""
    stacked, modular = (allocate_kv_caches(model, 3 * 8 + 1, BLOCK_SIZE) for _ in range(2))
    for queries in steps:
        expected = None
        with modules_only(model):
            expected = step(model, modular, queries)
        assert torch.equal(step(model, stacked, queries), expected), queries
        assert all(torch.equal(a, b) for a, b in zip(stacked, modular)), queries


def test_decodes_verify_queries_and_a_short_chunk_match_the_modules(model: torch.nn.Module) -> None:
    # prompts (prefill-sized: the modules in both), then steps the stack takes: one-token decodes, a
    # 4-token query (the decode kernel), a 9-token chunk after a cached context (the prefill kernel)
    both_paths(model, [[(0, 40), (0, 23), (0, 70)], [(40, 1), (23, 1), (70, 1)], [(41, 1), (24, 4), (71, 9)],
                       [(42, 8), (28, 8), (80, 16)]])  # 32 tokens: the most the stack takes


def test_the_stack_takes_up_to_the_block_kernels_rows(model: torch.nn.Module) -> None:
    x = torch.zeros(MAX_KERNEL_ROWS, 576)
    assert model.cpu_stack is not None and model.cpu_stack.takes(x)
    assert not model.cpu_stack.takes(torch.zeros(MAX_KERNEL_ROWS + 1, 576))  # the modules: prefill-sized projections
    assert not model.cpu_stack.takes(x.double())


def test_a_layer_that_computes_more_is_not_stacked(model: torch.nn.Module) -> None:
    layers = list(model.model.layers)
    assert LlamaCPUStack.for_layers(layers) is not None
    layers[3].cpu_stack_compatible = False  # e.g. Qwen3's q/k norms
    try:
        assert LlamaCPUStack.for_layers(layers) is None
    finally:
        del layers[3].cpu_stack_compatible


def test_float_weights_and_other_backends_run_the_modules(model: torch.nn.Module) -> None:
    float_model = load_model(ModelConfig(quantization=Quantization.NONE, num_hidden_layers_override=2), "cpu",
                             torch.float32, "cpu").module
    assert float_model.cpu_stack is None
    small = load_model(ModelConfig(quantization=Quantization.GGUF, num_hidden_layers_override=2), "cpu",
                       torch.float32, "cpu").module
    assert small.cpu_stack is not None and small.cpu_stack.takes(torch.zeros(1, 576))
    small.set_attention_backend(TorchAttentionBackend())  # the reference backend: its own K/V writes and reads
    assert not small.cpu_stack.takes(torch.zeros(1, 576))
