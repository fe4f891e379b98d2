"""Speculative decoding on the real embedded SmolLM2 in float32 (CPU): greedy tokens are the same with
speculation off, n-gram lookup, and a draft model -- the target itself (every draft accepted) or the
target truncated to its first layers (some accepted) -- driven by the contract-keeping toy scheduler."""

from __future__ import annotations

import pytest
from spec_harness import SpecScheduler, SpecStats

from conveyor.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, SpeculativeMethod
from conveyor.engine.tokenizer import Tokenizer
from conveyor.model.loader import embedded_gguf_path
from conveyor.sampling_params import SamplingParams
from conveyor.worker.model_runner import ModelRunner

pytestmark = pytest.mark.slow

TEXTS = [
    "Copy this sentence exactly, twice: The quick brown fox jumps over the lazy dog near the river bank.\n"
    "The quick brown fox",
    "def add(a, b):\n    return a + b\n\n# The same function with type hints:\ndef add(",
    "Question: What is the capital of France?\nAnswer:",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tokenizer = Tokenizer.from_path(embedded_gguf_path())
    return [tokenizer.encode(text) for text in TEXTS]


def generate(prompts: list[list[int]], config: SpeculativeConfig | None) -> tuple[list[list[int]], SpecStats]:
    runner = ModelRunner(ModelConfig(), CacheConfig(block_size=16, kv_cache_memory_bytes=32 * 2**20),
                         SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=256),
                         DeviceConfig(num_threads=1), config)
    runner.initialize_kv_cache()
    scheduler = SpecScheduler(lookahead=config.num_lookahead_tokens if config else 0)
    for index, prompt in enumerate(prompts):
        scheduler.add(f"r{index}", prompt, GREEDY)
    outputs = scheduler.run(runner)
    return [outputs[f"r{index}"] for index in range(len(prompts))], scheduler.stats


def draft(num_layers: int | None) -> SpeculativeConfig:
    return SpeculativeConfig(SpeculativeMethod.DRAFT_MODEL, 3, model=str(embedded_gguf_path()),
                             num_hidden_layers_override=num_layers)


def test_greedy_tokens_identical_with_every_proposer(prompts: list[list[int]]) -> None:
    reference, _ = generate(prompts, None)
    assert all(len(tokens) == 20 for tokens in reference)
    ngram, ngram_stats = generate(prompts, SpeculativeConfig(SpeculativeMethod.NGRAM, 3, prompt_lookup_min=2,
                                                              prompt_lookup_max=4))
    assert ngram == reference and ngram_stats.num_accepted > 0
    same, same_stats = generate(prompts, draft(None))
    assert same == reference and same_stats.num_drafts > 40 and same_stats.acceptance_rate == 1.0
    truncated, truncated_stats = generate(prompts, draft(26))
    assert truncated == reference and 0.0 < truncated_stats.acceptance_rate < 1.0
