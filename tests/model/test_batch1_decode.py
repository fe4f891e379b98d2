"""A batch-1 decode takes the factored one-row block kernels (kernels/cpu/gguf_matmul.c, `*_one_row`); the
same sequence decoded twice in one batch takes the tile path, the formula before it. On the embedded
SmolLM2 both give the same greedy tokens, logits within float32 accumulation error of each other."""

from __future__ import annotations

import pytest
import torch
from paged import allocate_kv_caches

from conveyor.config import ModelConfig, Quantization
from conveyor.engine.tokenizer import Tokenizer
from conveyor.kernels.cpu_build import cpu_kernels_available
from conveyor.model.attention_metadata import SequenceSpec, build_attention_metadata
from conveyor.model.loader import embedded_gguf_path, load_model

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="needs the C CPU kernels")
BLOCK_SIZE, NUM_BLOCKS_EACH, NUM_STEPS = 16, 4, 32
TEXTS = ["Question: What is the capital of France?\nAnswer:", "def fibonacci(n):\n    "]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return load_model(ModelConfig(quantization=Quantization.GGUF), "cpu", torch.float32, "cpu").module


def greedy(model: torch.nn.Module, prompt: list[int], copies: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens of `prompt` decoded as `copies` identical sequences in one batch, and the first
    copy's logits per step [NUM_STEPS, V]."""
    caches = allocate_kv_caches(model, copies * NUM_BLOCKS_EACH + 1, BLOCK_SIZE)
    blocks = [list(range(1 + c * NUM_BLOCKS_EACH, 1 + (c + 1) * NUM_BLOCKS_EACH)) for c in range(copies)]
    tokens, logits, start, step_ids = [], [], 0, list(prompt)
    for _ in range(NUM_STEPS):
        n = len(step_ids)
        metadata = build_attention_metadata([SequenceSpec(n, start + n, b) for b in blocks], BLOCK_SIZE, "cpu")
        positions = list(range(start, start + n)) * copies
        with torch.no_grad():
            hidden = model(torch.tensor(step_ids * copies), torch.tensor(positions), caches, metadata)  # [copies n, H]
            rows = model.compute_logits(hidden[n - 1::n])  # [copies, V]: each copy's last token
        assert all(torch.equal(rows[0], row) for row in rows), "copies of one sequence differ"
        tokens.append(int(rows[0].argmax()))
        logits.append(rows[0])
        start, step_ids = start + n, [tokens[-1]]
    return tokens, torch.stack(logits)


@pytest.mark.parametrize("text", TEXTS)
def test_one_row_q4_kernel_keeps_greedy_tokens_and_logits(model: torch.nn.Module, text: str) -> None:
    prompt = Tokenizer.from_path(embedded_gguf_path()).encode(text)
    one_tokens, one_logits = greedy(model, prompt, copies=1)  # decodes: one input row per projection
    tile_tokens, tile_logits = greedy(model, prompt, copies=2)  # two rows: the tile path
    assert one_tokens == tile_tokens
    # float32 accumulation error over 30 layers (5.5e-5 seen), on logits up to ~45
    torch.testing.assert_close(one_logits, tile_logits, atol=2e-4, rtol=1e-5)
