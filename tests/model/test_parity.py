"""Greedy parity with Hugging Face transformers on the embedded SmolLM2 GGUF (float32, eager).

transformers dequantizes and un-permutes the GGUF with its own code, so this checks our loader,
layers and paged attention (chunked prefill with cached prefixes mixed with decodes) together.
transformers is the reference for the dequantized float32 path; the GGUF blocks served as they are
(with the C paged-decode attention) must then give the same greedy tokens and the same logits up
to float32 accumulation error.
"""

from __future__ import annotations

import pytest
import torch

from conveyor.config import ModelConfig, Quantization
from conveyor.kernels.cpu_build import cpu_kernels_available
from conveyor.model.attention import get_attention_backend
from conveyor.model.quantized import QuantizedLinear
from conveyor.engine.tokenizer import Tokenizer
from conveyor.model.loader import embedded_gguf_path, load_model
from tests.model.paged import greedy_generate

transformers = pytest.importorskip("transformers")

NUM_NEW_TOKENS = 32
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    [{"role": "user", "content": "Write a haiku about continuous batching."}],
    [{"role": "user", "content": "List three prime numbers."}],
]


@pytest.fixture(scope="module")
def prompt_ids() -> list[list[int]]:
    tokenizer = Tokenizer.from_gguf(embedded_gguf_path())
    texts = [p if isinstance(p, str) else tokenizer.apply_chat_template(p) for p in PROMPTS]
    return [tokenizer.encode(t) for t in texts]


@pytest.fixture(scope="module")
def our_model():
    return load_model(ModelConfig(quantization=Quantization.NONE), "cpu", torch.float32).module


@pytest.mark.slow
def test_greedy_tokens_and_logits_match_transformers(hf_smollm2, our_model, prompt_ids) -> None:
    ours, our_logits = greedy_generate(our_model, prompt_ids, NUM_NEW_TOKENS, chunk_size=7)
    for ids, tokens, logits in zip(prompt_ids, ours, our_logits):
        with torch.no_grad():
            # An explicit mask: otherwise generate() masks every prompt token equal to pad_token_id.
            out = hf_smollm2.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=NUM_NEW_TOKENS, do_sample=False,
                output_logits=True, return_dict_in_generate=True, pad_token_id=2, eos_token_id=None,
            )
        assert tokens == out.sequences[0, len(ids):].tolist()
        reference = torch.cat(out.logits)  # [new tokens, vocab]
        assert (reference - logits).abs().max().item() < 2e-3


@pytest.mark.slow
def test_model_shape_attributes(our_model) -> None:
    assert (our_model.num_layers, our_model.num_kv_heads, our_model.head_dim) == (30, 3, 64)
    assert our_model.dtype == torch.float32


@pytest.mark.slow
@pytest.mark.skipif(not cpu_kernels_available(), reason="no C compiler for the CPU kernels")
def test_gguf_blocks_match_the_float32_path(our_model, prompt_ids) -> None:
    native = load_model(ModelConfig(quantization=Quantization.GGUF), "cpu", torch.float32).module
    native.set_attention_backend(get_attention_backend("cpu"))
    assert isinstance(native.model.layers[0].mlp.gate_up_proj, QuantizedLinear)
    ours, our_logits = greedy_generate(our_model, prompt_ids, NUM_NEW_TOKENS, chunk_size=7)
    theirs, native_logits = greedy_generate(native, prompt_ids, NUM_NEW_TOKENS, chunk_size=7)
    assert theirs == ours
    for expected, logits in zip(our_logits, native_logits):  # |logits| reach ~45: float32 rounding
        assert (expected - logits).abs().max().item() < 5e-4
