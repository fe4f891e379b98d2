"""The engine on the real embedded SmolLM2 (CPU): greedy outputs do not depend on how requests are
batched, chunked, cached or preempted, and match Hugging Face transformers token for token.

One ModelRunner is loaded per module and shared: each variant gets its own scheduler (the policy
under test) over the runner's KV cache, so the only thing that changes between runs is scheduling.
"""

from __future__ import annotations

import time

import pytest

from conveyor.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from conveyor.engine.engine_core import ModelLimits, make_engine_core
from conveyor.engine.llm import LLM, CompletionResult, engine_config_from_kwargs
from conveyor.engine.model_files import tokenizer_path
from conveyor.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

BASE = EngineConfig(
    scheduler=SchedulerConfig(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=64),
    cache=CacheConfig(block_size=16, kv_cache_memory_bytes=64 * 2**20),
    device=DeviceConfig(num_threads=1),  # the CPU is shared: more threads than free cores spin and crawl
    check_invariants=True,
)
PREFIX = "You are a careful assistant. Answer in one short sentence, then stop. Question: "
QUESTIONS = [
    "What is the capital of France?", "Why is the sky blue?", "Name a prime number.", "What is 2+2?",
    "Who wrote Hamlet?", "What do bees make?", "How many legs does a spider have?", "What is water made of?",
    "Translate 'merci' to English.", "What color is grass?", "What is the largest planet?",
    "Which animal barks?", "What is ice?", "Spell 'cat' backwards.", "What comes after Monday?",
    "Is the Moon a star?",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def shared():
    from conveyor.engine.tokenizer import Tokenizer
    from conveyor.worker.model_runner import ModelRunner

    runner = ModelRunner(BASE.model, BASE.cache, BASE.scheduler, BASE.device)
    capacity = runner.initialize_kv_cache()
    tokenizer = Tokenizer.from_path(tokenizer_path(ModelConfig()))
    return runner, capacity.num_blocks, tokenizer


def make_llm(shared, **overrides: object) -> LLM:
    from conveyor.core.policies import make_scheduler

    runner, num_blocks, tokenizer = shared
    config = engine_config_from_kwargs(BASE, **overrides)
    blocks = config.cache.num_blocks_override or num_blocks
    scheduler = make_scheduler(config.scheduler, config.cache, blocks, time.monotonic)
    limits = ModelLimits(blocks, config.scheduler.max_model_len, tuple(runner.eos_token_ids), runner.vocab_size)
    return LLM.from_core(make_engine_core(config, runner, scheduler, limits), tokenizer, config)


def token_ids(results: list[CompletionResult]) -> list[list[int]]:
    return [r.output_token_ids for r in results]


def prompts(tokenizer) -> list[list[int]]:
    """Shared-prefix prompts padded to 12 past a block boundary, so 8 decode steps cross into a new
    block (what forces preemption in a small pool)."""
    filler = tokenizer.encode(" ok")
    result = []
    for question in QUESTIONS:
        ids = tokenizer.encode(PREFIX + question)
        while len(ids) % 16 != 12:
            ids += filler
        result.append(ids)
    return result


@pytest.fixture(scope="module")
def reference(shared) -> list[list[int]]:
    """Continuous batching, chunked prefill (64-token budget), prefix caching, batch of 16."""
    llm = make_llm(shared)
    results = llm.generate(prompts(shared[2]), GREEDY)
    assert all(len(r.output_token_ids) == 8 for r in results)
    assert sum(r.num_cached_tokens for r in results) > 0, "shared prefixes should hit the prefix cache"
    return token_ids(results)


@pytest.mark.parametrize("overrides", [
    {"enable_chunked_prefill": False, "max_num_batched_tokens": 512},
    {"enable_prefix_caching": False},
    {"max_num_seqs": 1},
    {"batching": "static"},
    {"async_scheduling": True},
], ids=["no-chunked-prefill", "no-prefix-caching", "batch-of-1", "static", "async-scheduling"])
def test_greedy_outputs_do_not_depend_on_scheduling(shared, reference, overrides) -> None:
    llm = make_llm(shared, **overrides)
    assert token_ids(llm.generate(prompts(shared[2]), GREEDY)) == reference


def test_greedy_outputs_survive_preemption(shared, reference) -> None:
    llm = make_llm(shared, num_blocks_override=10, enable_prefix_caching=False)
    results = llm.generate(prompts(shared[2]), GREEDY)
    assert llm.last_run.num_preemptions > 0
    assert token_ids(results) == reference


def test_async_scheduling_survives_preemption(shared, reference) -> None:
    llm = make_llm(shared, num_blocks_override=10, enable_prefix_caching=False, async_scheduling=True)
    results = llm.generate(prompts(shared[2]), GREEDY)
    assert llm.last_run.num_preemptions > 0
    assert token_ids(results) == reference


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.0, logprobs=2, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=40, min_tokens=3),  # stops at EOS: one step wasted in flight
], ids=["seeded-random", "penalties", "logprobs", "eos"])
def test_async_scheduling_gives_the_synchronous_outputs(shared, params) -> None:
    """Placeholders resolve to exactly the tokens, logprobs and stops of the synchronous loop."""
    questions = prompts(shared[2])[:6]
    sync = make_llm(shared).generate(questions, params)
    pipelined = make_llm(shared, async_scheduling=True).generate(questions, params)
    assert [(r.output_token_ids, r.finish_reason, r.text) for r in pipelined] == \
        [(r.output_token_ids, r.finish_reason, r.text) for r in sync]
    assert shared[0]._pending is None  # the last step in flight was collected


def test_matches_transformers_greedy(shared, hf_smollm2) -> None:
    import torch

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
               "The three primary colors are"]
    ours = make_llm(shared).generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    for prompt, result in zip(prompts, ours):
        input_ids = torch.tensor([result.prompt_token_ids])
        with torch.inference_mode():
            generated = hf_smollm2.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=32,
                                            do_sample=False, pad_token_id=2, eos_token_id=None)
        assert result.output_token_ids == generated[0, input_ids.shape[1]:].tolist(), prompt


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async-scheduling"])
def test_split_engine_streams_and_aclose_frees_blocks(shared, async_scheduling: bool) -> None:
    """The real model behind the engine-core loop and its sockets, with the API-side client; with async
    scheduling (AsyncEngineCore) the streamed text is the offline synchronous one."""
    import asyncio

    from proc_harness import serving

    from conveyor.engine.types import GenerateRequest

    llm = make_llm(shared, async_scheduling=async_scheduling)
    tokenizer = shared[2]
    usage: list[float] = []

    async def consume(client, request_id: str, question: str) -> list:  # noqa: ANN001
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        request = GenerateRequest(request_id, tokenizer.encode(PREFIX + question), params)
        return [out async for out in client.generate(request)]

    offline = make_llm(shared).generate([tokenizer.encode(PREFIX + q) for q in QUESTIONS[:4]],
                                        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))

    async def main() -> None:
        async with serving(llm.core, tokenizer=tokenizer) as served:
            client = served.client
            client.add_stats_listener(lambda stats: usage.append(stats.scheduler.kv_cache_usage)
                                      if stats.scheduler else None)
            results = await asyncio.gather(*(consume(client, f"c{i}", q) for i, q in enumerate(QUESTIONS[:4])))
            assert all(outs[-1].num_output_tokens == 6 for outs in results)
            assert ["".join(o.new_text for o in outs) for outs in results] == [r.text for r in offline]
            stream = client.generate(GenerateRequest("gone", tokenizer.encode(PREFIX), SamplingParams(max_tokens=400)))
            await stream.__anext__()
            await stream.aclose()  # the client went away
            for _ in range(200):
                if client.num_unfinished_requests() == 0 and usage and usage[-1] == 0.0:
                    break
                await asyncio.sleep(0.02)
            assert usage[-1] == 0.0

    asyncio.run(main())
